"""The comparison as people read it: ``compare.md`` (with the two PNG plots of
:mod:`onegpu.compare.plots`) and the terminal table.

Input is an :class:`onegpu.compare.groups.Comparison`; nothing here touches MLflow.
"""
from __future__ import annotations

from pathlib import Path

from onegpu.compare.groups import RESUMED_BY, Comparison, GroupComparison
from onegpu.compare.plots import (
    LOSS_PLOT,
    MAX_PLOTTED_GROUPS,
    MEMORY_PLOT,
    plot_loss_curves,
    plot_memory_vs_throughput,
)
from onegpu.compare.tolerances import EPS, GRAD_NORM_TOLERANCES, TOLERANCE_BASIS, TOLERANCES
from onegpu.compare.verdict import DIVERGED, EQUIVALENT, EVAL_METRICS
from onegpu.formatting import markdown_table, mib, num, ratio, sci, signed, text_table

REPORT_FILE = "compare.md"

EXPLANATION = """\
## What "equivalent" means here

Runs share an `equivalence_key` when everything that decides the mathematics of training is equal:
data, model, optimizer, schedule, seed, precision and the effective batch (examples per optimizer step).
Left out of the key are only the ways of doing the same work: the split of the effective batch into
micro-batch x accumulation, activation checkpointing and the backend
(`onegpu.equivalence.NOT_IN_EQUIVALENCE_KEY`).
With the loss normalised over the whole effective batch, a split changes only the order of
floating-point sums, and checkpointing recomputes the same activations, so such runs should follow the
same loss curve.

A run is **equivalent** to its group's reference when its loss and its gradient norm at every
optimizer step it shares with the reference are within the tolerance of its precision,
`|x - ref| <= atol + rtol * |ref|`, and it has as many optimizer steps. **diverged at step N** names
the first step beyond a tolerance (`(grad_norm)` when the gradient norm left it first).

{tolerances}
 Rounding differences are far below it; a real difference in what is computed (another
dropout mask per micro-batch, BatchNorm statistics over a smaller micro-batch) moves the loss past it
at once, and the likely causes found in the runs' params and tags are listed. With dropout on, runs of
one key are the same training in expectation, not step by step; set `model.dropout: 0` to compare exactly.

The reference of a group is the run with the largest micro-batch (then checkpointing off, then the
earliest). Memory and speed columns are the price of each split: peak memory during training (CUDA
allocator peak, or process RSS peak on CPU), samples per second and seconds per optimizer step, and
both relative to the reference. They compare only runs that trained alone: a value marked
{mark} comes from a run whose training overlapped in time with another run's on the same machine
(e.g. `dvc queue start -j 2`), so the runs shared the cores and its speed and memory are not comparable,
or, on its speed only, from a run that trained under outside load: other processes took at least a
tenth of the CPUs (or used the GPU) over its training window (tag `onegpu.outside_load`).
"""

OVERLAP_MARK = "*"


def tolerance_table() -> str:
    """Markdown table of the per-precision tolerances (loss, grad_norm), machine epsilon and basis."""
    rows = [[p, f"{EPS[p]:.3g}", f"{t.rtol:g} / {t.atol:g}",
             f"{GRAD_NORM_TOLERANCES[p].rtol:g} / {GRAD_NORM_TOLERANCES[p].atol:g}", TOLERANCE_BASIS[p]]
            for p, t in TOLERANCES.items()]
    return markdown_table(["precision", "eps", "loss rtol / atol", "grad_norm rtol / atol", "basis"], rows)


# -- formatting ------------------------------------------------------------------------------------

def _cost(text: str, comparable: bool) -> str:
    return text if comparable or text == "-" else text + OVERLAP_MARK


def _not_comparable(rows) -> list[str]:
    """Why each run's marked costs are not comparable: ``<run> trained at the same time as ...`` and
    ``<run> trained under outside load (<the figures>)``."""
    out = [f"{c.run.label} trained at the same time as {', '.join(c.overlaps)}" for c in rows if c.overlaps]
    return out + [f"{c.run.label} trained under outside load ({c.run.under_load})" for c in rows if c.run.under_load]


def _eval_columns(g: GroupComparison) -> list[str]:
    return [m for m in EVAL_METRICS if any(m in c.eval_deltas for c in g.rows)]


# -- Markdown --------------------------------------------------------------------------------------

def _group_table(g: GroupComparison) -> list[str]:
    evals = _eval_columns(g)
    head = ["run", "micro x accum", "ckpt", "precision", "steps", "verdict", "max abs Δ loss",
            "max rel Δ loss", "max abs Δ grad_norm", "max rel Δ grad_norm", *[f"Δ {m}" for m in evals], "peak MiB",
            "memory vs ref", "samples/s", "speed vs ref", "mean step s"]
    rows = []
    for c in g.rows:
        r = c.run
        verdict = f"**{c.verdict}**" if c.status == DIVERGED else c.verdict
        cells = [f"{r.label} (`{r.run_id[:8]}`)", f"{r.micro_batch} x {r.accumulation}",
                 "yes" if r.checkpointing else "no", r.precision, str(r.steps), verdict]
        if c.is_reference:
            cells += ["-", "-", "-", "-", *["-" for _ in evals]]
        else:
            cells += [sci(c.loss.max_abs), sci(c.loss.max_rel), sci(c.grad_norm.max_abs),
                      sci(c.grad_norm.max_rel), *[signed(c.eval_deltas.get(m)) for m in evals]]
        ok = c.cost_comparable and g.rows[0].cost_comparable  # a ratio needs both runs alone
        fast = c.speed_comparable and g.rows[0].speed_comparable
        cells += [_cost(mib(r.peak_memory_bytes, unit=False), c.cost_comparable), _cost(ratio(c.memory_ratio), ok),
                  _cost(num(r.samples_per_second), c.speed_comparable), _cost(ratio(c.throughput_ratio), fast),
                  _cost(num(r.mean_step_time_s, ".3f"), c.speed_comparable)]
        rows.append(cells)
    lines = markdown_table(head, rows).splitlines()
    flagged = _not_comparable(g.rows)
    if flagged:
        lines += ["", f"{OVERLAP_MARK} not comparable: " + "; ".join(flagged)
                  + ". Time splits one run at a time (`dvc queue start -j 1`) on a quiet machine."]
    return lines


def _group_section(g: GroupComparison, index: int) -> list[str]:
    ref = g.reference
    out = [f"## Group {index}: `{g.key}`", "",
           f"Effective batch {ref.effective_batch} examples per optimizer step, {ref.precision}, "
           f"device {ref.tags.get('device', '?')}.", "", g.summary, ""]
    out += _group_table(g)
    if any(c.notes or c.status == DIVERGED for c in g.rows):
        out += ["", "Details:", ""]
    for c in g.rows:
        if c.status == DIVERGED:
            out.append(f"- **{c.run.label}** ({c.run.split}) {c.verdict}: loss differs by "
                       f"{sci(c.loss.max_abs)} at most (step {c.loss.max_abs_step}), grad_norm by "
                       f"{sci(c.grad_norm.max_rel)} relative at most; tolerances {c.tolerance.rtol:g} (loss) "
                       f"and {c.grad_norm_tolerance.rtol:g} (grad_norm) relative ({c.precision}).")
            if c.causes:
                out += [f"  - likely cause: {cause}" for cause in c.causes]
            else:
                out.append(f"  - {c.no_cause} (else: check data order, seed and code version).")
        for note in c.notes:
            out.append(f"- {c.run.label}: {note}")
    out.append("")
    return out


def continued_line(comparison: Comparison) -> str:
    """The stopped runs left out of the comparison, each with the run that resumed it (and carries its steps)."""
    names = {r.run_id: r.label for g in comparison.groups for r in g.runs}
    pairs = ", ".join(f"{r.label} (resumed by {names.get(r.tags.get(RESUMED_BY, ''), 'a later run')})"
                      for r in comparison.continued)
    return (f"{len(comparison.continued)} stopped run(s) left out, their steps being the first of the run that "
            f"resumed them: {pairs}.")


def markdown(comparison: Comparison, experiment: str = "", store: str = "",
             images: tuple[str, ...] = (LOSS_PLOT, MEMORY_PLOT)) -> str:
    """The report as Markdown: what equivalent means, then one section per ``equivalence_key`` with a
    table (verdicts, per-step differences, eval deltas, peak memory in MiB, samples per second, seconds
    per optimizer step) and the likely causes of each divergence. ``images`` are linked at the end."""
    tol = tolerance_table()
    n_runs = sum(len(g.rows) for g in comparison.groups)
    lines = ["# Equivalence and trade-offs of training runs", ""]
    where = f" in MLflow experiment `{experiment}`" if experiment else ""
    lines.append(f"{n_runs} training run{'s' if n_runs != 1 else ''}{where}, in {len(comparison.groups)} "
                 f"group{'s' if len(comparison.groups) != 1 else ''} of equal `equivalence_key`"
                 + (f" (store `{store}`)." if store else "."))
    if comparison.skipped:
        lines.append(f"{len(comparison.skipped)} run(s) without an `equivalence_key` tag were left out: "
                     + ", ".join(r.label for r in comparison.skipped) + ".")
    if comparison.continued:
        lines.append(continued_line(comparison))
    lines += ["", *markdown_table(["group", "key", "runs", "equivalent", "diverged", "summary"],
                                  [[str(i), f"`{g.key}`", str(len(g.rows)), str(g.count(EQUIVALENT)),
                                    str(g.count(DIVERGED)), g.summary]
                                   for i, g in enumerate(comparison.groups, 1)]).splitlines()]
    lines += ["", EXPLANATION.format(tolerances=tol, mark=f"`{OVERLAP_MARK}`")]
    for i, g in enumerate(comparison.groups, 1):
        lines += _group_section(g, i)
    if images:
        lines += ["## Plots", ""]
        lines += [f"![{Path(p).stem.replace('_', ' ')}]({p})" for p in images]
        if len(comparison.groups) > MAX_PLOTTED_GROUPS:
            lines.append(f"\nLoss curves show the {MAX_PLOTTED_GROUPS} most recent groups.")
        lines.append("")
    return "\n".join(lines)


# -- terminal --------------------------------------------------------------------------------------

def terminal_table(comparison: Comparison, summaries: bool = True, width: int = 100) -> str:
    """A compact plain-text table, one row per run: name, micro x accumulation, checkpointing, verdict,
    max |Δ loss| against the reference, peak memory (MiB) and training samples per second; with
    ``summaries``, each group's summary below its table, wrapped at ``width`` characters."""
    import textwrap
    head = ("run", "micro x accum", "ckpt", "verdict", "max |d loss|", "peak MiB", "samples/s")
    out = []
    for i, g in enumerate(comparison.groups, 1):
        rows = []
        for c in g.rows:
            r = c.run
            rows.append((r.label, f"{r.micro_batch} x {r.accumulation}", "yes" if r.checkpointing else "no",
                         c.verdict, "-" if c.is_reference else sci(c.loss.max_abs),
                         _cost(mib(r.peak_memory_bytes, unit=False), c.cost_comparable),
                         _cost(num(r.samples_per_second), c.speed_comparable)))
        out.append(f"group {i} key {g.key} ({len(g.rows)} run{'s' if len(g.rows) != 1 else ''}, "
                   f"{g.count(EQUIVALENT)} equivalent, {g.count(DIVERGED)} diverged)")
        out += text_table(head, rows, right=(4, 5, 6))
        flagged = _not_comparable(g.rows)
        if flagged:
            out += textwrap.wrap(f"{OVERLAP_MARK} not comparable: " + "; ".join(flagged) + "; time one run at a "
                                 "time (dvc queue start -j 1) on a quiet machine", width, initial_indent="  ",
                                 subsequent_indent="  ")
        if summaries:
            out += textwrap.wrap(g.summary, width, initial_indent="  ", subsequent_indent="  ")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def write(comparison: Comparison, out_dir: str | Path, experiment: str = "", store: str = "") -> list[Path]:
    """Write ``compare.md``, ``loss_curves.png`` and ``memory_vs_throughput.png`` into ``out_dir``
    (created if missing) and return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    loss = plot_loss_curves(comparison, out / LOSS_PLOT)
    mem = plot_memory_vs_throughput(comparison, out / MEMORY_PLOT)
    md = out / REPORT_FILE
    md.write_text(markdown(comparison, experiment, store, images=(LOSS_PLOT, MEMORY_PLOT)).rstrip("\n") + "\n",
                  encoding="utf-8")
    return [md, loss, mem]
