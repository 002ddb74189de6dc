"""``onegpu ui`` in a real browser: the printed link opens the training runs, with their loss, in
MLflow's model-training view (not the GenAI view MLflow 3 opens by default)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.browser import load, require_chromium

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Final losses chosen to print exactly in the runs table.
TRAINING = {"split-8x1": (8, 1, 0.8125), "split-2x4": (2, 4, 0.6875)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fill_store(root: Path) -> list[str]:
    """A prepare run, two training runs (tags and metrics as the stages log them) and a comparison run."""
    from onegpu import tracking
    from onegpu.training import closing_record, run_tags
    tr = tracking.connect("onegpu", root=root)
    prep = tr.start_run("prepare-run", {"stage": "prepare"})
    tr.log_metrics(prep, {"prepare_runtime": 1.0, "prepare_rows_per_second": 100.0, "prepare_mem_peak_bytes": 1e8})
    tr.end_run(prep)
    ids = []
    for name, (micro, accum, final) in TRAINING.items():
        rid = tr.start_run(name, {"stage": "train", "equivalence_key": "k" * 16, "device": "cpu"})
        tr.log_params(rid, {"resolved.per_device_train_batch_size": micro,
                            "resolved.gradient_accumulation_steps": accum, "train.gradient_checkpointing": False})
        buf = tr.metric_buffer(rid)
        rows = [(step, {"loss": loss, "grad_norm": 2.0 / step, "mem_peak_bytes": 2e8, "samples_per_second": 40.0})
                for step, loss in enumerate((1.5, 1.0, final), start=1)]
        ROWS_SHOWN[:] = rows  # the last run's: the latest, whose page onegpu ui links
        for step, metrics in rows:
            buf.add(metrics, step)
        buf.flush()
        summary = {"train_mem_peak_bytes": 2e8, "train_samples_per_second": 40.0}
        tr.log_metrics(rid, {**summary, "eval_loss": 0.5})
        # what the train stage logs at its end: the figure as the run's description, the table's tags
        load = {"cpu_busy": 1.42, "cpus": 2, "share": 0.71, "loadavg": [12.0, 12.5], "window_s": 60.0}
        tr.set_tags(rid, {"config": f"bs{micro}x{accum}-fp32", **run_tags.table_tags(summary)})
        closing_record.log_closing(tr, rid, rows, load, False, f"bs{micro}x{accum}-fp32")
        tr.end_run(rid)
        ids.append(rid)
    tracking.log_comparison(tr, [], ids, ["k" * 16])
    return ids


from onegpu.training import figure as session_figure  # noqa: E402

ROWS_SHOWN: list = []  # the steps of the run whose page is shown (filled by _fill_store)


def _commands(pid: int) -> list[str]:
    """The command lines of process ``pid``'s descendants (those still running)."""
    import psutil
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            out.append(" ".join(child.cmdline()))
        except psutil.NoSuchProcess:
            pass
    return out


def _keep(*shots: Path) -> None:
    """Copy the screenshots to ``$ONEGPU_SCREENSHOTS`` when set (pytest keeps its last 3 temp folders only)."""
    keep = os.environ.get("ONEGPU_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for shot in shots:
            if shot.is_file():
                shutil.copy(shot, Path(keep) / shot.name)


def _figure_pixels(png: Path) -> int:
    """Pixels of the training figure's background colour (``figure.FACE``, which MLflow's UI never uses)
    in a screenshot: how much of the figure the page's first screen shows."""
    from PIL import Image

    from onegpu.training.figure import FACE
    face = tuple(int(FACE[i:i + 2], 16) for i in (1, 3, 5))
    img = Image.open(png).convert("RGB")
    return sum(1 for px in img.getdata() if all(abs(a - b) <= 3 for a, b in zip(px, face)))


@pytest.mark.slow
def test_ui_link_opens_training_runs_with_loss_in_model_training_view(tmp_path, monkeypatch):
    require_chromium()
    root = tmp_path / "project"
    (root / ".git").mkdir(parents=True)  # the project root onegpu looks for
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    for k in [k for k in os.environ if k.startswith(("MLFLOW_", "DVC_"))]:
        monkeypatch.delenv(k)
    monkeypatch.chdir(root)
    ids = _fill_store(root)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([str(BIN / "onegpu"), "ui", "--port", str(_free_port())], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, link, deadline = [], None, time.monotonic() + 90
        while link is None and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            out.append(line)
            m = re.search(r"(http://127\.0\.0\.1:\d+/#/experiments/\d+/runs\S*)", line)
            link = m.group(1) if m else None
        assert link, f"onegpu ui printed no link:\n{''.join(out)}"
        assert "workflowType=machine_learning" in link and "viewStateShareKey=" in link
        # MLflow's GenAI job runner is off: no huey consumers beside the UI (seven of them by default)
        assert [c for c in _commands(proc.pid) if "huey" in c or "_job_runner" in c] == []

        page = load(link, screenshot=tmp_path / "runs.png")
        _keep(tmp_path / "runs.png")
        text = page.text
        for name, (_, _, final) in TRAINING.items():
            assert name in text, f"training run {name} not on the page:\n{text[:3000]}"
            assert str(final) in text, f"loss {final} of {name} not on the page"
        assert "prepare-run" not in text and "compare-" not in text  # only training runs in the table
        for column in ("loss", "eval_loss"):
            assert column in text, f"column {column} missing"
        # The model-training view, not MLflow 3's GenAI one (its sidebar: Sessions, Judges, Agent versions)
        assert "Runs" in text and "Training runs" not in text
        for genai in ("Agent versions", "Judges", "Evaluation runs", "Sessions"):
            assert genai not in text, f"GenAI view opened ({genai!r} on the page)"
        assert any(u.startswith(link.split("#")[0]) and "ajax-api" in u for u in page.requests)
        assert page.screenshot is not None and page.screenshot.stat().st_size > 10_000
        for column in ("config", "memory", "speed", "outside_load"):  # people's units in the table
            assert column in text, f"column {column} missing"
        assert "bs8x1-fp32" in text and "191 MiB" in text and "40.00 samples/s" in text and "71% of 2 CPUs" in text

        # the latest run's page, in the model-training view, as onegpu ui prints it
        printed = next((ln for ln in [proc.stdout.readline()] if "the latest training run" in ln), "")
        assert f"the latest training run, split-2x4: {link.split('?')[0]}/{ids[-1]}?workflowType=machine_learning" \
            in printed, printed
        run_page = printed.split(": ", 1)[1].strip()
        shot = tmp_path / "run.png"
        page = load(run_page, screenshot=shot)
        assert "get-artifact?path=training_steps.png" in page.dom, "the run page shows no training figure"
        assert any("get-artifact" in u and session_figure.THUMBNAIL in u for u in page.requests)
        _keep(shot)
        # whole: the description needs no "Show more" (MLflow truncates it past 150 px), and it is on screen
        img = re.search(r"<img[^>]*training_steps[^>]*>", page.dom)
        assert 'data-testid="show-comment-toggle"' not in page.dom, \
            f"the run's figure is cut off (Show more): {img.group(0) if img else None}"
        # at least 3/4 of the thumbnail's own background shows on the first screen (the whole strip, not a slice)
        thumb = tmp_path / "thumb.png"
        session_figure.plot_steps(ROWS_SHOWN, "", thumbnail=True).savefig(thumb)
        assert _figure_pixels(shot) > 0.75 * _figure_pixels(thumb), (
            "the training figure is not whole on the first screen")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
