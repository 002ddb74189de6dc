"""The runs of one ``equivalence_key`` together: the reference of each group, every other run compared
with it (:mod:`onegpu.compare.verdict`), runs whose training overlapped in time on one machine, and the
groups of a whole comparison. No MLflow here."""
from __future__ import annotations

from dataclasses import dataclass, field

from onegpu.compare.records import RunRecord
from onegpu.compare.summary import summarize
from onegpu.compare.verdict import DIVERGED, EQUIVALENT, GroupComparison, compare_run


@dataclass
class Comparison:
    """Every group, most recently started first, and the runs left out: ``skipped`` (no ``equivalence_key`` tag)
    and ``continued`` (stopped runs that a run here resumed: their steps are its first, :func:`split_continued`)."""
    groups: list[GroupComparison]
    skipped: list[RunRecord] = field(default_factory=list)
    continued: list[RunRecord] = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        return [g.key for g in self.groups]

    @property
    def run_ids(self) -> list[str]:
        return [r.run_id for g in self.groups for r in g.runs]

    def counts(self) -> dict[str, int]:
        """The comparison run's metrics: runs, groups, equivalent and diverged runs."""
        return {"compare_runs": len(self.run_ids), "compare_groups": len(self.groups),
                "compare_equivalent": sum(g.count(EQUIVALENT) for g in self.groups),
                "compare_diverged": sum(g.count(DIVERGED) for g in self.groups)}


def group_by_key(runs: list[RunRecord]) -> tuple[dict[str, list[RunRecord]], list[RunRecord]]:
    """``({equivalence_key: runs}, runs without a key)``; keys in first-seen order."""
    groups: dict[str, list[RunRecord]] = {}
    skipped = []
    for r in runs:
        if r.key is None:
            skipped.append(r)
        else:
            groups.setdefault(r.key, []).append(r)
    return groups, skipped


RESUMED_BY, RESUMED_FROM, RESUMED_AT = "onegpu.resumed_by", "onegpu.resumed_from", "onegpu.resumed_at_step"


def split_continued(runs: list[RunRecord]) -> tuple[list[RunRecord], list[RunRecord]]:
    """``(runs to compare, stopped runs left out)``: a stopped run that another of ``runs`` resumed (tag
    ``onegpu.resumed_by``) is left out, since the run that resumed it carries its steps as its first ones;
    compared, the two would be "equal" on steps that were measured once."""
    ids = {r.run_id for r in runs}
    continued = [r for r in runs if r.tags.get(RESUMED_BY) in ids]
    return [r for r in runs if r not in continued], continued


def resumed_note(run: RunRecord, before: RunRecord | None) -> str | None:
    """For ``run``, which resumed ``before`` (its ``onegpu.resumed_from`` run; None when not at hand) with another
    split: which of its steps that run trained, and how; None otherwise."""
    if before is None or before.layout == run.layout:
        return None
    (m, a, n), at = before.layout, run.tags.get(RESUMED_AT, "?")
    where = f" on {n} process(es)" if n else ""
    return (f"steps 1-{at} are run {before.label}'s, trained at {m} x {a}{where}; it resumed them, and its own split "
            "applies from the next step")


def choose_reference(runs: list[RunRecord]) -> RunRecord:
    """The run the others are compared with: the largest micro-batch (the fewest accumulated
    micro-batches, the plainest computation of the effective batch); on a tie, checkpointing off; then
    the earliest start. Runs with a per-step loss are preferred over runs without one.
    """
    if not runs:
        raise ValueError("choose_reference needs at least one run")
    with_loss = [r for r in runs if r.series.get("loss")] or runs
    return min(with_loss, key=lambda r: (-(r.micro_batch or 0), r.checkpointing, r.start_time, r.run_id))


def _machine(r: RunRecord) -> str | None:
    return r.tags.get("onegpu.machine") or None


def find_overlaps(runs: list[RunRecord], others: list[RunRecord] = (),
                  min_overlap_ms: int = 1000) -> dict[str, list[str]]:
    """For each of ``runs``: the labels of runs (among ``runs`` and ``others``) whose training windows
    (:attr:`RunRecord.train_window`) overlapped its own by more than ``min_overlap_ms`` on the same
    machine (tag ``onegpu.machine``; runs without it are taken to share the machine). Runs of unknown
    window are never flagged. Returns ``{run_id: [label, ...]}`` for the runs that overlapped.
    """
    pool = {r.run_id: r for r in [*runs, *others]}
    out: dict[str, list[str]] = {}
    for r in runs:
        w = r.train_window
        if w is None:
            continue
        for o in pool.values():
            if o.run_id == r.run_id or o.train_window is None:
                continue
            if _machine(r) and _machine(o) and _machine(r) != _machine(o):
                continue
            ow = o.train_window
            if min(w[1], ow[1]) - max(w[0], ow[0]) > min_overlap_ms:
                out.setdefault(r.run_id, []).append(o.label)
    return out


def _sort_key(r: RunRecord):
    return (-(r.micro_batch or 0), r.accumulation or 0, r.checkpointing, r.start_time)


def compare_group(key: str, runs: list[RunRecord], overlaps: dict[str, list[str]] | None = None) -> GroupComparison:
    """Compare every run of one ``equivalence_key`` with the group's reference (:func:`choose_reference`);
    ``overlaps`` (:func:`find_overlaps`) marks runs whose speed and memory are not comparable."""
    ref = choose_reference(runs)
    others = sorted((r for r in runs if r is not ref), key=_sort_key)
    rows = [compare_run(ref, ref)] + [compare_run(r, ref) for r in others]
    for c in rows:
        c.overlaps = list((overlaps or {}).get(c.run.run_id, []))
        if c.overlaps:
            c.notes.append(f"trained at the same time as {', '.join(c.overlaps)} on the same machine: its "
                           "speed and memory are not comparable (train one at a time for timing, e.g. "
                           "`dvc queue start -j 1`)")
        if c.run.under_load:
            c.notes.append(f"trained under outside load ({c.run.under_load}): its speed is not the cost of "
                           "its split alone (train it again on a quiet machine to time it)")
    g = GroupComparison(key=key, reference=ref, rows=rows)
    g.summary = summarize(g)
    return g


def compare(runs: list[RunRecord], others: list[RunRecord] = (), named: bool = False) -> Comparison:
    """Group ``runs`` by ``equivalence_key`` and compare each group. Groups with something to compare
    (two runs or more) come first, then single runs; within each, the most recently started first.
    ``others``: further training runs (not compared) whose windows count for :func:`find_overlaps`.
    ``named``: the user named these runs (``--exp``, ``--runs``): runs of several keys are then compared
    as one group (key ``KEY1+KEY2...``), each run of another key than the reference's diverging where
    its curves leave the reference's, its key's differing params the cause."""
    compared, continued = split_continued(runs)
    groups, skipped = group_by_key(compared)
    if named and len(groups) > 1:
        groups = {"+".join(k[:8] for k in groups): [r for rs in groups.values() for r in rs]}
    overlaps = find_overlaps(compared, [*others, *continued])
    out = [compare_group(k, rs, overlaps) for k, rs in groups.items()]
    by_id = {r.run_id: r for r in runs}
    for c in (c for g in out for c in g.rows):
        if note := resumed_note(c.run, by_id.get(c.run.tags.get(RESUMED_FROM, ""))):
            c.notes.append(note)
    out.sort(key=lambda g: (len(g.rows) < 2, -max(r.start_time for r in g.runs)))
    return Comparison(groups=out, skipped=skipped, continued=continued)
