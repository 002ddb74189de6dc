"""What ran a benchmark and what else ran beside it: the machine line every result starts with
(:func:`describe`, :func:`line`), and other processes' load, waited out before a run and measured during it
(:func:`clean_run`, :func:`load_note`).

A small shared machine runs other work (test suites, builds) now and then; a run that overlaps it is
measured again. "Other load" = what the train stage tags as outside load (tag onegpu.outside_load): the
whole machine's busy CPU time (psutil, steal included) less this process tree's, per second of wall
time, in cores.
"""
from __future__ import annotations

import datetime
import platform
import time

CONTENTION_LIMIT = 0.2


class OtherLoad:
    """``with OtherLoad() as load: ...`` then ``load.cores``: other processes' CPU use during the block
    (this process and its children are not "other"; :class:`onegpu.measure.outside_load.Watch`)."""

    def __enter__(self):
        from onegpu.measure import outside_load
        self._watch = outside_load.Watch()
        self._watch.start()
        return self

    def __exit__(self, *exc):
        figures = self._watch.stop()
        self.cores = figures["cpu_busy"] if figures else 0.0
        return False


def wait_quiet(max_wait: float, limit: float = CONTENTION_LIMIT) -> float:
    """Wait (up to ``max_wait`` s) until other processes use less than ``limit`` cores for 2 s in a row.

    Returns the seconds waited.
    """
    t0 = time.perf_counter()
    quiet_windows = 0
    while time.perf_counter() - t0 < max_wait:
        with OtherLoad() as load:
            time.sleep(1.0)
        quiet_windows = quiet_windows + 1 if load.cores < limit else 0
        if quiet_windows >= 2:
            break
    return time.perf_counter() - t0


def clean_run(fn, args, label: str = "") -> dict:
    """``fn()`` (which builds its model and trains, returning a result dict) on a quiet machine.

    Waits for quiet first; reruns (``args.retries`` times at most) when other processes used more than
    :data:`CONTENTION_LIMIT` cores during the run. The result gets ``other_load_cores``, ``attempts``
    and ``waited_s``.
    """
    waited, best = 0.0, None
    for attempt in range(1 + max(0, args.retries)):
        waited += wait_quiet(args.max_wait)
        with OtherLoad() as load:
            res = fn()
        res["other_load_cores"] = round(load.cores, 3)
        if best is None or res["other_load_cores"] < best["other_load_cores"]:
            best = res  # if every attempt overlapped other work, keep the least disturbed one
        if load.cores <= CONTENTION_LIMIT or attempt == max(0, args.retries):
            break
        print(f"  {label}: other processes used {load.cores:.2f} cores during the run; measuring again",
              flush=True)
    best.update(attempts=attempt + 1, waited_s=round(waited, 1))
    return best


def load_note(results: list[dict]) -> str:
    """One line on other load: how many runs were measured again and the worst load kept."""
    redone = sum(r.get("attempts", 1) - 1 for r in results)
    worst = max((r.get("other_load_cores", 0.0) for r in results), default=0.0)
    waited = sum(r.get("waited_s", 0.0) for r in results)
    s = (f"Other load on the machine: runs measured again because other processes used > "
         f"{CONTENTION_LIMIT} cores: {redone}; highest other load in a kept run: {worst:.2f} cores; "
         f"waited {waited:.0f} s for quiet.")
    if worst > CONTENTION_LIMIT:
        s += " Some kept runs overlapped other work: treat their numbers with care."
    return s


def _cpu_model() -> str:
    from onegpu.measure.flops import cpu_model
    return cpu_model() or platform.processor() or platform.machine()


def describe() -> dict:
    """What ran the benchmark: CPU model, cores, GPU, library versions, date."""
    import mlflow
    import torch
    import transformers

    from onegpu.measure import memory
    info = {"cpu": _cpu_model(), "arch": platform.machine(), "cores": memory.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cuda": torch.version.cuda if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "mlflow": mlflow.__version__,
            "date": datetime.date.today().isoformat()}
    try:
        with open("/proc/meminfo") as f:
            info["ram_gib"] = round(int(f.readline().split()[1]) / 2**20)
    except (OSError, ValueError, IndexError):
        pass
    return info


def line(m: dict) -> str:
    dev = f"GPU {m['gpu']} (CUDA {m['cuda']})" if m.get("gpu") else "no GPU"
    ram = f", {m['ram_gib']} GiB RAM" if m.get("ram_gib") else ""
    return (f"Machine: {m['cpu']} ({m['arch']}), {m['cores']} cores (torch threads {m['torch_threads']}){ram}, "
            f"{dev}; Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
            f"mlflow {m['mlflow']}; {m['date']}")
