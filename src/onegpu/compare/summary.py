"""A few sentences on one group of runs: how many match the reference, the first divergence and its
likely causes, and the cheapest equivalent run in memory and the fastest in samples per second."""
from __future__ import annotations

from onegpu.compare.verdict import DIVERGED, EQUIVALENT, INCOMPLETE, NO_DATA, GroupComparison
from onegpu.formatting import mib


def summarize(g: GroupComparison) -> str:
    """A few sentences on one group: how many runs match the reference, the first divergence and its
    likely causes, and the cheapest equivalent run in memory and the fastest in samples per second."""
    ref = g.reference
    n = len(g.rows)
    head = f"{n} run{'s' if n != 1 else ''}; reference {ref.label} ({ref.split}, {ref.precision})."
    partial = sorted({p["step"] for c in g.rows for p in c.run.partial_steps})
    if partial:
        head += (f" Step{'s' if len(partial) > 1 else ''} {', '.join(map(str, partial))} saw fewer examples "
                 "than the effective batch (an epoch's short last step).")
    if n == 1:
        micro, eff = ref.micro_batch, ref.effective_batch
        other = next((m for m in ((micro or 0) // 2, (micro or 0) * 2) if m and eff and eff % m == 0), None)
        how = (f"`dvc exp run -S train.per_device_train_batch_size={other} "
               f"-S train.gradient_accumulation_steps={eff // other}`" if other else "another split")
        return head + f" Nothing to compare yet: train the same configuration as {how}, or with " \
                      f"`train.gradient_checkpointing` {'off' if ref.checkpointing else 'on'}."
    others = g.rows[1:]
    parts = [head]
    eq = [c for c in others if c.status == EQUIVALENT]
    div = [c for c in others if c.status == DIVERGED]
    if eq:
        parts.append(f"{len(eq)} of {len(others)} equivalent to it step by step "
                     f"(loss within {eq[0].tolerance.rtol:g} and grad_norm within "
                     f"{eq[0].grad_norm_tolerance.rtol:g} relative in {eq[0].precision}).")
    if div:
        parts.append(f"{len(div)} diverged: " + "; ".join(_divergence(c) for c in
                                                         sorted(div, key=lambda c: c.first_divergent_step)) + ".")
    rest = [c for c in others if c.status in (INCOMPLETE, NO_DATA)]
    if rest:
        parts.append(f"{len(rest)} not comparable over all steps ({', '.join(c.run.label for c in rest)}).")
    overlapped = [c for c in g.rows if not c.cost_comparable]
    if overlapped:
        parts.append(f"Speed and memory not comparable for {', '.join(c.run.label for c in overlapped)}: "
                     "trained at the same time as other runs on one machine.")
    loaded = [c for c in g.rows if c.cost_comparable and c.run.under_load]
    if loaded:
        parts.append("Speed not comparable for " + "; ".join(f"{c.run.label} (under outside load: {c.run.under_load})"
                                                             for c in loaded) + ".")
    parts.append(_cheapest([c for c in [g.rows[0]] + eq if c.cost_comparable]))
    return " ".join(p for p in parts if p)


def _divergence(c) -> str:
    """One diverged run in words: where, and its own likely causes (or that no setting differs)."""
    where = f"{c.run.label} at step {c.first_divergent_step}"
    if c.first_divergent_step == 1 and c.first_step:
        metric, rel = max(c.first_step.items(), key=lambda kv: kv[1])
        where += f" ({metric} {rel:.1e} relative, beyond the noise floor of the first step)"
    elif c.first_divergent_metric == "grad_norm":
        where += " (grad_norm)"
    causes = [cause.split(":")[0] for cause in c.causes]
    return where + (f", likely cause{'s' if len(causes) > 1 else ''}: {', '.join(causes)}" if causes
                    else f", {c.no_cause}")


def _cheapest(candidates: list) -> str:
    """The least-memory and the fastest of ``candidates`` (the reference and its equivalent runs that
    trained alone), in one sentence; the fastest only among runs timed without outside load. '' for
    fewer than two candidates."""
    mem = [c for c in candidates if c.run.peak_memory_bytes is not None]
    fast = [c for c in candidates if c.speed_comparable and c.run.samples_per_second is not None]
    if len(candidates) < 2 or not mem or not fast:
        return ""
    lo = min(mem, key=lambda c: c.run.peak_memory_bytes)
    speed = f"{lo.run.samples_per_second:.1f} samples/s" + ("" if lo.speed_comparable else " under outside load")
    text = (f"Among the equivalent runs, the least memory: {lo.run.split} "
            f"({mib(lo.run.peak_memory_bytes, missing='?')}, {speed})")
    if len(fast) < 2:
        return text + "; no fastest: the others' speeds were measured under outside load."
    hi = max(fast, key=lambda c: c.run.samples_per_second)
    return text + (f"; the fastest: {hi.run.split} ({hi.run.samples_per_second:.1f} samples/s, "
                   f"{mib(hi.run.peak_memory_bytes, missing='?')}).")

