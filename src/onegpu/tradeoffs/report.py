"""``onegpu tradeoffs``' report: the measured table as Markdown, plain text and a PNG (rows from
:mod:`onegpu.tradeoffs.measurement`). No MLflow or DVC here."""
from __future__ import annotations

import textwrap
from pathlib import Path

from onegpu.compare.plots import pyplot
from onegpu.formatting import gib, markdown_table, mib, num, ratio, text_table
from onegpu.tradeoffs.measurement import DIFFERENT_TRAINING, NOT_RUN, SAME_TRAINING, Row, failed
from onegpu.tradeoffs.pool import WORKERS
from onegpu.tradeoffs.recommend import MIN_GAIN, Recommendation, confirmed, load_reason, spread

REPORT_FILE = "tradeoffs.md"
PLOT_FILE = "tradeoffs.png"

# What the Hugging Face guide's table says of each knob ("GPU" page of the transformers docs,
# https://huggingface.co/docs/transformers/perf_train_gpu_one, and PEFT from its earlier "Methods and tools
# for efficient training on a single GPU" table): (training speed, memory usage).
GUIDE = {
    "split": ("batch size: yes / yes; gradient accumulation: no / yes"),
    "checkpointing": "no / yes",
    "precision": "yes / depends",
    "tf32": "yes / depends (mixed precision)",
    "optimizer": "yes / yes",
    "attention": "SDPA: yes / yes",
    "compile": "yes / no",
    "allocator": "not in the guide (PyTorch's CPU tuning guide: an allocator that reuses memory)",
    "lora": "PEFT: no / yes",
    "padding_free": "not in the guide (TRL's padding_free: no compute or memory on padding)",
    "packing": "not in the guide (TRL's packing: no padding, other examples per step)",
    "activation_offloading": "not in the guide (TRL's activation_offloading: device memory for PCIe traffic)",
    "fused_lm_head": "not in the guide (TRL's fused LM head, Liger's fused linear cross-entropy: no whole logits)",
    "reference": "not in the guide (TRL's precompute_ref_log_probs: no reference model in memory or per step)",
    "sharding": ("not in the guide (PyTorch FSDP2: per-rank params, grads and optimizer states down by about N; an "
                 "all-gather per block in forward and backward and a reduce-scatter of gradients per step: more "
                 "communication, slower on one machine)"),
}


def _time_to_loss(r: Row) -> str:
    if r.run is None or r.variant.knob == "baseline":
        return num(r.time_to_test_loss_s)
    if r.time_to_test_loss_s is not None:
        return num(r.time_to_test_loss_s)
    return "not reached" if r.test_loss is not None else "no test loss"


def combined_row(measured: Row | None) -> list[Row]:
    """The combined recommendation's own row, when it ran (a single knob's row is in the table already)."""
    return [measured] if measured and measured.run and measured.variant.knob == "recommended" else []


def ratios(rows: list[Row], measured: Row | None) -> dict[str, float]:
    """The MLflow metrics of the tradeoffs run: ``speedup/<row>``, ``memory_ratio/<row>`` and
    ``recommended_speedup`` (the recommendation's measured speed-up)."""
    out = {f"speedup/{r.variant.name}": r.speedup for r in rows if r.speedup is not None}
    out.update({f"memory_ratio/{r.variant.name}": r.memory_ratio for r in rows if r.memory_ratio is not None})
    if measured is not None and measured.speedup is not None:
        out["recommended_speedup"] = measured.speedup
    return out


def _spread(r: Row) -> str:
    """The min-max of a row's repeats (``0.95x-1.08x``), or nothing with one run."""
    return f"{r.speedup_range[0]:.2f}x-{r.speedup_range[1]:.2f}x" if r.speedup_range and r.repeats > 1 else ""


def _cells(r: Row) -> list[str]:
    v = r.variant
    if r.run is None:
        return [v.name, v.what, GUIDE.get(v.knob, ""), "", "", "", "", "", "", "", "", "", r.verdict]
    return [v.name, v.what, GUIDE.get(v.knob, ""), num(r.samples_per_second, ".2f"), ratio(r.speedup), _spread(r),
            num(r.first_step_s, ".2f"), mib(r.memory_bytes, unit=False), ratio(r.memory_ratio),
            num(r.train_runtime_s), num(r.test_loss, ".4f"), _time_to_loss(r), r.verdict]


HEAD = ["row", "change", "the guide says (speed / memory)", "samples/s (steady steps)", "vs baseline (median)",
        "min-max of repeats", "step 1 (s)", "memory (MiB)", "vs baseline", "train time (s)", "test loss",
        "time to baseline's test loss (s)", "verdict"]


def _budget(rec: Recommendation) -> str:
    return "" if rec.budget_bytes is None else f" within the memory budget {gib(rec.budget_bytes)}"


def _incomplete(rec: Recommendation, rows: list[Row]) -> list[str]:
    measured, planned = rec.incomplete
    missing = [f"{r.variant.name} ({r.verdict})" for r in rows if r.run is None and not failed(r)]
    return [f"**Incomplete: {measured} of {planned} rows measured**: no recommendation (it would rest on the "
            "rows that happened to run). Missing: " + ", ".join(missing) + ". Run the batch again "
            "(`onegpu tradeoffs`), or, when its rows are still queued, `onegpu tradeoffs --report` after them."]


def recommendation_lines(rec: Recommendation, measured: Row | None, rows: list[Row] = ()) -> list[str]:
    """The closing paragraph: the fastest same-training configuration that fits the budget, the ``-S``
    arguments that apply it, and its measured speed-up and verdict (``measured``: its run against the
    baseline, None when not run yet); for an incomplete batch (``rows`` missing) that nothing is
    recommended; for a combination its own repeats must confirm it."""
    if rec.incomplete is not None:
        return _incomplete(rec, list(rows))
    out = []
    if rec.variant is None:
        out.append(f"**Recommendation:** keep your params. No knob that keeps the same training was clearly "
                   f"(at least {MIN_GAIN:.0%}, and beyond the repeats' spread) faster{_budget(rec)}.")
    elif measured is not None and measured.run is not None and not confirmed(measured, list(rows)):
        out.append(f"**Recommendation:** keep your params. Together ({rec.variant.what}) the faster knobs "
                   f"measured {spread(measured) if measured.speedup else '-'} the baseline's samples/s, verdict "
                   f"**{measured.verdict}**: no clear difference, so the combination is not recommended.")
    elif rec.variant.knob == "recommended" and (measured is None or measured.run is None):
        out.append("**No recommendation yet:** the knobs that were clearly faster alone ("
                   + ", ".join(f"{r.variant.name} {ratio(r.speedup)}" for r in rec.parts) + ") have not been "
                   f"measured together ({measured.verdict if measured is not None else NOT_RUN}), and knobs do "
                   f"not multiply exactly; their combination, to measure: `dvc exp run {rec.variant.set_text}`.")
    else:
        out.append(f"**Recommendation** (the fastest configuration measured that keeps the same training"
                   f"{_budget(rec)}): `dvc exp run {rec.variant.set_text}`")
        if measured is not None and measured.run is not None:
            base = next((r.samples_per_second for r in rows if r.variant.knob == "baseline"), None)
            if base is None and measured.speedup:
                base = measured.samples_per_second / measured.speedup
            out.append(f"Measured: {spread(measured)} the baseline's samples/s "
                       f"({num(measured.samples_per_second, '.2f')} vs {num(base, '.2f')}),"
                       f" memory {ratio(measured.memory_ratio)}, verdict against the baseline: "
                       f"**{measured.verdict}**.")
    if rec.left_out:
        out.append("Not taken: " + "; ".join(f"{name} ({why})" for name, why in rec.left_out) + ".")
    return out


def window_text(plan: dict) -> str:
    """The measured window in words, for the report's header, from a batch's kept ``plan``
    (:func:`onegpu.tradeoffs.batch.load_plan`): its ``steps`` (None: the whole job), ``repeats`` and
    ``runner`` (``workers``: the rows trained in worker processes, :mod:`onegpu.tradeoffs.pool`; else each
    as a DVC experiment)."""
    steps, repeats, in_workers = plan.get("steps"), plan.get("repeats", 1), plan.get("runner") == WORKERS
    what = (f"The probe window: each row trains its first {steps} optimizer steps (`train.max_steps={steps}`, "
            "the baseline too, so the learning-rate schedule spans those steps) up to the train stage; "
            "evaluate and validation (`train.eval_strategy=no`) are skipped, so there is no test loss." if steps else
            "The whole job: each row trains the job to its end and evaluates it (`--full`).")
    what += (" The rows trained in worker processes on the data prepared once, each an MLflow run of its own "
             "(no DVC experiment each: `--full` and `--queue-only` rows are DVC experiments)." if in_workers else
             " Each row is a DVC experiment of its own (`dvc exp show`).")
    counts = plan.get("windows")
    if counts:  # the adaptive rounds (onegpu.tradeoffs.windows)
        most = max(counts.values())
        return what + (f" Each row ran once, then again in interleaved rounds (the baseline and the rows whose next "
                       f"window could still change the recommendation; at most {repeats}): "
                       f"{sum(1 for n in counts.values() if n == most)} of {len(counts)} rows ran {most} times, the "
                       "others fewer (their notes say why); a ratio is the median of each window against the "
                       "baseline of its round, with their min-max." if most > 1 else
                       " Each row ran once: none was left whose next window could change the recommendation, so "
                       "no spread was measured.")
    return what + (f" Each row ran {repeats} times, in interleaved rounds (baseline, each knob; again): "
                   "the ratio is the median of each repeat against the baseline of its round, with their "
                   "min-max." if repeats > 1 else " Each row ran once: no spread measured (`--repeats`).")


def markdown(rows: list[Row], rec: Recommendation, measured: Row | None, title: str,
             image: str | None = PLOT_FILE, skipped: list[str] = (), window: str = "",
             timing: list[str] = ()) -> str:
    """The whole report: a header naming the device and the measured ``window``, the table, notes (with
    ``timing``: the rows' wall time and overhead) and the recommendation."""
    base = next((r for r in rows if r.variant.knob == "baseline"), None)
    device = base.run.tags.get("device", "?") if base and base.run else "?"
    kind = next((r.memory_kind for r in rows if r.memory_kind), "")
    lines = [f"# {title}", "",
             f"Device: {device}. The rows trained one at a time; each row changes one "
             "knob of the baseline (your params). samples/s over the steady optimizer steps: steps 2..N less any "
             "that compiled (warm-up: step 1's time is its own column, the seconds compiled are in the notes). "
             "Memory: "
             + ("the CUDA allocator peak." if kind == "allocator peak" else
                "params + grads + optimizer states + one micro-batch's saved activations (bytes; on CPU the "
                "process RSS hides what checkpointing and precision save).")
             + " Verdict: the run's per-step loss and gradient norm against the baseline's "
             f"(`onegpu compare`'s tolerances): {SAME_TRAINING}, same within a precision's tolerance, or "
             f"{DIFFERENT_TRAINING} (another optimizer or LoRA: another equivalence key). Test loss is measured "
             "once, after training: a row reaches the baseline's test loss when its own is at least as low."
             + (f" {window}" if window else ""), ""]
    if image:
        lines += [f"![speed and memory per knob]({image})", ""]
    lines += markdown_table(HEAD, [_cells(r) for r in rows + combined_row(measured)]).splitlines()
    lines.append("")
    measured_rows = [r for r in rows if r.run is not None and r.variant.knob != "baseline"]
    shared = set.intersection(*(set(r.notes) for r in measured_rows)) if measured_rows else set()
    notes = [f"- every row: {n}" for n in sorted(shared)] if len(measured_rows) > 1 else []
    notes += [f"- {r.variant.name}: {n}" for r in rows for n in r.notes if n not in shared or len(measured_rows) < 2]
    notes += [f"- {r.variant.name}: {load_reason(r)}; its samples/s is not the knob's cost (not taken as a "
              "speed gain)" for r in rows if load_reason(r)]
    if skipped:
        notes += [f"- not measured: {s}" for s in skipped]
    notes += [f"- {t}" for t in timing]
    if notes:
        lines += notes + [""]
    lines += recommendation_lines(rec, measured, rows)
    return "\n".join(lines).rstrip("\n") + "\n"


def terminal(rows: list[Row], rec: Recommendation, measured: Row | None, width: int = 100) -> str:
    """A compact plain-text table (row, samples/s ratio, memory ratio, train time, verdict) and the
    recommendation, wrapped at ``width``."""
    head = ("row", "samples/s", "vs base", "min-max", "memory MiB", "vs base", "train s", "verdict")
    body = [(r.variant.name, num(r.samples_per_second, ".2f"), ratio(r.speedup), _spread(r),
             mib(r.memory_bytes, unit=False), ratio(r.memory_ratio), num(r.train_runtime_s), r.verdict)
            for r in rows + combined_row(measured)]
    out = text_table(head, body, right=(1, 2, 3, 4, 5, 6))
    for para in recommendation_lines(rec, measured, rows):
        out += textwrap.wrap(para.replace("**", ""), width, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(out) + "\n"


def figure(rows: list[Row], title: str):
    """Two horizontal bar charts, one bar per measured row: samples/s and memory relative to the
    baseline (1.0 = the baseline; a dashed line marks it). Bars of rows that keep the same training are
    filled, others hatched. Returns the matplotlib Figure."""
    plt = pyplot()
    measured = [r for r in rows if r.run is not None and r.speedup is not None]
    names = [r.variant.name for r in measured][::-1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(names) + 1.8), sharey=True)
    for ax, attr, label in ((axes[0], "speedup", "samples/s vs baseline (higher: faster)"),
                            (axes[1], "memory_ratio", "memory vs baseline (lower: less)")):
        vals = [getattr(r, attr) or 0.0 for r in measured][::-1]
        same = [r.same_training for r in measured][::-1]
        bars = ax.barh(names, vals, color=["tab:blue" if s else "tab:orange" for s in same])
        for b, s in zip(bars, same):
            if not s:
                b.set_hatch("//")
        for b, v in zip(bars, vals):
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {v:.2f}", va="center", fontsize=8)
        ax.axvline(1.0, color="k", linestyle="--", linewidth=1)
        ax.set_xlabel(label)
        ax.set_xlim(0, max(vals + [1.0]) * 1.2)
    fig.suptitle(f"{title}\nfilled: same training (exactly or up to dropout masks); hatched: within a precision's "
                 "tolerance or a different training", fontsize=10)
    fig.tight_layout()
    return fig


def write(rows: list[Row], rec: Recommendation, measured: Row | None, out_dir: str | Path, title: str,
          skipped: list[str] = (), window: str = "", timing: list[str] = ()) -> list[Path]:
    """Write ``tradeoffs.md`` and ``tradeoffs.png`` into ``out_dir`` (created if missing); return both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig = figure(rows + combined_row(measured), title)
    png = out / PLOT_FILE
    fig.savefig(png, dpi=110)
    pyplot().close(fig)
    md = out / REPORT_FILE
    md.write_text(markdown(rows, rec, measured, title, PLOT_FILE, skipped, window, timing), encoding="utf-8")
    return [md, png]
