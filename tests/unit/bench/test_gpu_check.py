"""bench/gpu_check.sh's sections, read from the script: each section of ``ALL_SECTIONS`` is described in the
header (in that order, with its GPU limit in seconds), has a ``sec_<name>`` function exported to the bash that
runs it, a limit in both modes and a ``run_section`` call; each bench script a section runs has its SMOKE result
among those the rehearsal (bench/gpu_rehearsal.sh) wants back. The ``dpo`` section runs
``bench.vs_trl_dpo`` on the SmolLM2-shaped random-init model through ``bench_script`` (whose ``--bf16`` makes the
script train each arm in fp32 and again in bf16; tests/unit/bench/test_vs_trl_dpo.py tests that); the ``fsdp``
section runs ``bench.fsdp`` on that model in fp32 (``FP32=1``: no ``--bf16``)."""
from __future__ import annotations

import re
from pathlib import Path

from bench import gpu_preflight

BENCH = Path(__file__).resolve().parents[3] / "bench"
SCRIPT = (BENCH / "gpu_check.sh").read_text()


def sections() -> list[str]:
    return re.search(r'^ALL_SECTIONS="([^"]+)"', SCRIPT, re.M).group(1).split(",")


def header_limits() -> dict[str, int]:
    """Each section the header describes -> the limit (s) ending its description."""
    header = SCRIPT[:SCRIPT.index("\nset -uo pipefail")]
    block = header[header.index("in this order:"):header.index("# Each section writes")]
    out, name = {}, None
    for line in block.splitlines()[1:]:
        m = re.match(r"#   (\w+)\s", line)
        name = m.group(1) if m else name
        limit = re.search(r"\s(\d+)$", line)
        if limit and name:
            out[name] = int(limit.group(1))
    return out


def function(name: str) -> str:
    """The body of the shell function ``name``."""
    m = re.search(rf"^{name}\(\) {{.*?\n}}\n", SCRIPT, re.M | re.S)
    assert m, f"gpu_check.sh defines no {name}()"
    return m.group(0)


def limits(mode: str) -> dict[str, int]:
    """``L_*`` limits (s) of the SMOKE branch (``mode`` "smoke") or the GPU branch ("gpu")."""
    lines = re.findall(r"^    (L_TESTS=.*)$", SCRIPT, re.M)
    assert len(lines) == 2, lines
    return {k: int(v) for k, v in re.findall(r"(L_\w+)=(\d+)", lines[0 if mode == "smoke" else 1])}


def test_every_section_is_described_limited_defined_exported_and_run():
    names = sections()
    assert list(header_limits()) == names
    exported = re.search(r"^export -f (.*?[^\\])\n", SCRIPT, re.M | re.S).group(1).split()
    calls = dict(re.findall(r'^\s*run_section (\w+) "?\$?(\w+)"?', SCRIPT, re.M))
    for name in names:
        function(f"sec_{name}")
        assert f"sec_{name}" in exported, name
        assert name in calls, f"no run_section {name}"
        limit = calls[name]
        if limit.startswith("L_"):
            assert limit in limits("smoke"), limit
            assert limits("gpu")[limit] == header_limits()[name], f"{name}: the header's limit is not the GPU one"
        else:
            assert int(limit) == header_limits()[name], name


def test_each_bench_script_a_section_runs_comes_back_from_the_rehearsal():
    want = (BENCH / "gpu_rehearsal.sh").read_text()
    scripts = {s for name in sections() for s in re.findall(r"bench_script (\w+)", function(f"sec_{name}"))}
    assert {"split_sweep", "checkpointing", "vs_trl", "memory_knobs", "vs_trl_dpo"} <= scripts
    for script in scripts:
        assert f'"{script}-smoke.md"' in want, script


def test_the_dpo_section_runs_vs_trl_dpo_on_the_smollm2_model_in_fp32_and_bf16():
    assert "dpo" in sections()
    assert sections().index("dpo") < sections().index("tradeoffs")  # the tradeoffs rows report partially
    body = function("sec_dpo")
    assert "ensure_smollm2 || return 1" in body and "bench.vs_trl_dpo" in gpu_preflight.BENCH
    runs = re.findall(r'bench_script vs_trl_dpo --model "\$SMOLLM2" (.*)', body)
    assert len(runs) == 2, runs  # SMOKE sizes and the GPU's
    assert "--max-length 1024" in runs[1] and "--reps 1" in runs[1]
    assert "--bf16" in function("bench_script")  # vs_trl_dpo --bf16: each arm in fp32, then under bf16 autocast


def test_the_fsdp_section_runs_bench_fsdp_on_the_smollm2_model_in_fp32_after_dpo():
    names = sections()
    assert names.index("dpo") < names.index("fsdp") < names.index("tradeoffs")
    body = function("sec_fsdp")
    assert "ensure_smollm2 || return 1" in body and "bench.fsdp" in gpu_preflight.BENCH
    runs = re.findall(r'FP32=1 bench_script fsdp --model "\$SMOLLM2" (.*)', body)
    assert len(runs) == 2 and runs[0] == "--smoke", runs  # SMOKE sizes, then the GPU's
    assert "--max-length 1024" in runs[1] and "--accum 2" in runs[1]
    assert '[ "${FP32:-0}" = 1 ] && bf16=' in function("bench_script")  # fp32: the float32 floor is the bar
