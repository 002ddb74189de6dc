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
EVAL_ACCURACY = {"split-8x1": 0.90625, "split-2x4": 0.84375}
SFT_CFG = {"data": {"source": "bbcnews-headlines"},
           "model": {"task": "causal-lm", "name_or_path": "packaged:SmolLM2-135M-Instruct", "lora": {"r": 8}}}
TRAIN_INPUTS: list = []  # the (name, digest) of the inputs of the last training run (filled by _fill_store)
SFT_INPUTS: list = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _splits(n: int) -> dict:
    """Tiny train, validation and test tables (text, label) as the dataset inputs prepare and train log."""
    import pandas as pd
    return {s: pd.DataFrame({"text": [f"{s} row {i}" for i in range(n + k)], "label": [i % 2 for i in range(n + k)]})
            for k, s in enumerate(("train", "validation", "test"))}


def _with_model(tr, rid: str, cfg: dict, name: str, metrics: dict) -> tuple:
    """What train and evaluate log around a model: the datasets, the logged model (as train records it, with
    the DVC hash evaluate adds) and the eval metrics linked to the model and the test set. Returns the inputs'
    ``(name, digest)``s."""
    from onegpu.config import from_container
    from onegpu.models import record
    tables = _splits(4)
    inputs = tr.log_data_inputs(rid, [(tables[s], f"bbcnews-{s}", c) for s, c in
                                      (("train", "training"), ("validation", "validation"), ("test", "evaluation"))],
                                "data/processed@0123456789abcdef0123456789abcdef.dir")
    spec = record.logged_model(from_container(cfg), "k" * 16, name)
    spec.tags["onegpu.dvc_out"] = "models@fedcba9876543210fedcba9876543210.dir"
    tr.log_metrics(rid, metrics, model_id=tr.log_model(rid, spec), dataset=inputs[2])
    return inputs


def _fill_store(root: Path) -> list[str]:
    """A prepare run, an SFT run and a run stopped by Ctrl-C, two training runs (tags, metrics, datasets and
    models as the stages log them) and a comparison run. Returns the ids: killed, SFT, then TRAINING's."""
    import signal as signals

    from onegpu import tracking
    from onegpu.training.lifecycle import interrupt
    from onegpu.training.record import closing_record, run_tags
    tr = tracking.connect("onegpu", root=root)
    prep = tr.start_run("prepare-run", {"stage": "prepare"})
    tr.log_metrics(prep, {"prepare_runtime": 1.0, "prepare_rows_per_second": 100.0, "prepare_mem_peak_bytes": 1e8})
    tr.end_run(prep)
    rows = [(s, {"loss": 2.0 / s, "grad_norm": 1.0, "mem_peak_bytes": 2e8, "samples_per_second": 40.0})
            for s in (1, 2)]
    killed = tr.start_run("stopped-run", {"stage": "train", "equivalence_key": "k" * 16, "device": "cpu"})
    happened = closing_record.ending(interrupt.Interrupted(signals.SIGINT, 2), kept=2)
    closing_record.log_closing(tr, killed, rows, None, True, "bs4x2-fp32", happened=happened)
    tr.end_run(killed, "KILLED")
    sft = tr.start_run("sft-lora", {"stage": "train", "equivalence_key": "s" * 16, "device": "cpu"})
    SFT_INPUTS[:] = _with_model(tr, sft, SFT_CFG, "sft-lora", {"test_rouge_l": 0.4375, "test_loss": 2.5})
    tr.end_run(sft)
    ids = [killed, sft]
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
        tr.log_metrics(rid, summary)
        TRAIN_INPUTS[:] = _with_model(tr, rid, {}, name, {"test_loss": 0.5, "test_accuracy": EVAL_ACCURACY[name]})
        # what the train stage logs at its end: the figure as the run's description, the table's tags
        load = {"cpu_busy": 1.42, "cpus": 2, "share": 0.71, "loadavg": [12.0, 12.5], "window_s": 60.0}
        tr.set_tags(rid, {"config": f"bs{micro}x{accum}-fp32", **run_tags.table_tags(summary)})
        closing_record.log_closing(tr, rid, rows, load, False, f"bs{micro}x{accum}-fp32")
        tr.end_run(rid)
        ids.append(rid)
    tracking.log_comparison(tr, [], ids[2:], ["k" * 16])
    return ids


from onegpu.training.record import figure as session_figure  # noqa: E402

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

    from onegpu.training.record.figure import FACE
    face = tuple(int(FACE[i:i + 2], 16) for i in (1, 3, 5))
    img = Image.open(png).convert("RGB")
    return sum(1 for px in img.getdata() if all(abs(a - b) <= 3 for a, b in zip(px, face)))


WIDE = (3000, 1000)  # MLflow's tables draw only the columns in view: wide enough for all of them


def _check_killed_sft_and_models(runs_url: str, ids: list[str], models_url: str, tmp_path: Path) -> None:
    """The stopped run's page says what stopped it and how to resume, over its whole figure; the SFT run's
    lists its model with test_rouge_l; the Models tab lists every trained model with its eval metrics."""
    shot = tmp_path / "killed.png"
    page = load(f"{runs_url}{ids[0]}?workflowType=machine_learning", screenshot=shot)
    _keep(shot)
    assert "Stopped by SIGINT" in page.text and "To resume:" in page.text and "Killed" in page.text
    assert "get-artifact?path=training_steps.png" in page.dom
    assert 'data-testid="show-comment-toggle"' not in page.dom, "the stopped run's note and figure need Show more"
    assert _figure_pixels(shot) > 0

    page = load(f"{runs_url}{ids[1]}?workflowType=machine_learning")
    assert "Logged models (1)" in page.text and "test_rouge_l" in page.text and "0.4375" in page.text

    assert models_url.endswith("/models?workflowType=machine_learning"), models_url
    shot = tmp_path / "models.png"
    page = load(models_url, screenshot=shot, window=WIDE)
    _keep(shot)
    text = page.text
    for name in (*TRAINING, "sft-lora"):
        assert name in text, f"model {name} not in the Models tab:\n{text[:3000]}"
    assert "stopped-run" not in text  # a stopped training made no model
    for column in ("test_accuracy", "test_rouge_l"):  # (its params follow, past the window)
        assert column in text, f"column {column} missing from the Models tab"
    for value in (*EVAL_ACCURACY.values(), 0.4375):
        assert str(value) in text, f"{value} not in the Models tab"
    assert "Agent versions" not in text  # the model-training view of the tab


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

        page = load(link, screenshot=tmp_path / "runs.png", window=WIDE)
        _keep(tmp_path / "runs.png")
        text = page.text
        for name, (_, _, final) in TRAINING.items():
            assert name in text, f"training run {name} not on the page:\n{text[:3000]}"
            assert str(final) in text, f"loss {final} of {name} not on the page"
        assert "prepare-run" not in text and "compare-" not in text  # only training runs in the table
        for column in ("loss", "test_loss"):
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
        digest = dict(TRAIN_INPUTS)  # the Datasets column: train and validation with their digests
        for split in ("train", "validation"):
            assert f"bbcnews-{split} ({digest[f'bbcnews-{split}'][:8]})" in text, f"dataset {split} not in the table"

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
        # what it was trained on (prepare's digest; "+2": validation and test) and the model it made, with its
        # eval metrics on the test set
        text = page.text
        assert f"bbcnews-train ({digest['bbcnews-train'][:8]})" in text and "+2" in text
        assert "Logged models (1)" in text and f"bbcnews-test (#{digest['bbcnews-test']})" in text
        assert "test_accuracy" in text and str(EVAL_ACCURACY["split-2x4"]) in text
        models = next((ln for ln in [proc.stdout.readline()] if "Models tab" in ln), "")
        _check_killed_sft_and_models(f"{link.split('?')[0]}/", ids, models.split(": ", 1)[1].strip(), tmp_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
