"""Outside load (onegpu.measure.outside_load): other processes' CPU over a window, this process tree's left out."""
from __future__ import annotations

import json
import subprocess
import sys

from onegpu.measure import outside_load
from onegpu.measure.outside_load import Sample


def test_other_processes_cpu_is_the_machines_busy_time_less_this_trees_own_over_the_wall_time():
    # 10 s window on 4 CPUs: the machine was busy 30 CPU-seconds, this tree (two pids, one new) 18 of them.
    start = Sample(wall=100.0, busy_s=1000.0, own_s={1: 50.0}, loadavg=1.0)
    end = Sample(wall=110.0, busy_s=1030.0, own_s={1: 60.0, 2: 8.0}, loadavg=3.5)
    f = outside_load.figures(start, end, cpus=4)
    assert f["cpu_busy"] == 1.2 and f["share"] == 0.3 and f["loadavg"] == [1.0, 3.5] and f["window_s"] == 10.0
    assert outside_load.under_load(f)
    assert outside_load.describe(f) == "other processes used 1.20 of 4 CPUs (30%), load average 1.0 -> 3.5"
    # the tree alone kept the machine busy: no outside load (never negative)
    quiet = outside_load.figures(start, Sample(110.0, 1018.0, {1: 60.0, 2: 8.0}, 1.0), cpus=4)
    assert quiet["cpu_busy"] == 0.0 and not outside_load.under_load(quiet)


def test_under_load_from_a_tenth_of_the_cpus_or_any_other_gpu_process():
    assert not outside_load.under_load({"cpu_busy": 0.15, "cpus": 2, "share": 0.075})
    assert outside_load.under_load({"cpu_busy": 0.2, "cpus": 2, "share": 0.1})
    gpu = {"cpu_busy": 0.0, "cpus": 16, "share": 0.0, "gpu_processes": 1}
    assert outside_load.under_load(gpu) and outside_load.describe(gpu).endswith("; 1 other process on the GPU")
    assert not outside_load.under_load(None) and outside_load.describe(None) == ""
    assert outside_load.parse(json.dumps(gpu)) == gpu and outside_load.parse("not json") is None


def test_cpu_time_of_a_process_outside_the_watched_tree_counts_as_outside_load():
    """Watch a sleeping process's tree while this process (outside that tree) spins: at least this
    process's CPU seconds are counted as other processes' (the rest of the machine's load comes on top)."""
    import time
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        w = outside_load.Watch(root=sleeper.pid)
        w.start()
        cpu0, t0 = time.process_time(), time.monotonic()
        while time.monotonic() - t0 < 1.5:
            pass
        spun = time.process_time() - cpu0
        f = w.stop()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert f is not None and spun > 0.1
    assert f["cpu_busy"] * f["window_s"] >= spun - 0.05
    assert outside_load.under_load(f)
