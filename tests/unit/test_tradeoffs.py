"""onegpu tradeoffs: the plan of experiments, the rows measured from runs, the recommendation, the report."""
from __future__ import annotations

from pathlib import Path

import pytest

from onegpu import cli, config, tradeoffs, tradeoffs_report
from onegpu.equivalence import RunRecord, equivalence_key
from onegpu.stages.tradeoffs import parse_knobs
from onegpu.errors import UserError
from tests import defaults


def _cfg(**train) -> config.Config:
    raw = defaults.params()
    raw["train"].update(train)
    return config.from_container(raw)


def _names(variants):
    return [v.name for v in variants]


# -- plan ------------------------------------------------------------------------------------------

def test_plan_on_cpu_for_the_defaults():
    variants, skipped = tradeoffs.plan(_cfg())
    assert _names(variants) == ["baseline", "split-16x1", "checkpointing", "bf16", "adamw_torch_fused", "adafactor",
                                "attn-eager", "compile", "cpu-allocator-system", "lora"]
    by = {v.name: v for v in variants}
    assert by["split-16x1"].set_args == ["-S", "train.per_device_train_batch_size=16",
                                         "-S", "train.gradient_accumulation_steps=1"]
    assert by["baseline"].set_args == []
    assert by["lora"].set_args == ["-S", "model.lora.r=8"]  # the dotted form a user types
    assert [s.split(":")[0] for s in skipped] == ["tf32"]  # a no-op on CPU


def test_plan_on_cuda_adds_tf32_fp16_and_8bit():
    variants, skipped = tradeoffs.plan(_cfg(), cuda=True, bf16_supported=False, bnb_available=True)
    names = _names(variants)
    assert "fp16" in names and "bf16" not in names  # a GPU without bf16
    assert "tf32" in names and "adamw_bnb_8bit" in names and "cpu-allocator-system" not in names
    assert [s.split(":")[0] for s in skipped] == ["allocator"]  # host memory is not the tensors' on a GPU


def test_plan_turns_off_what_is_on_and_splits_the_other_way():
    variants, skipped = tradeoffs.plan(_cfg(gradient_checkpointing=True, bf16=True, torch_compile=True,
                                            per_device_train_batch_size=8, gradient_accumulation_steps=1))
    names = _names(variants)
    assert {"no-checkpointing", "fp32", "no-compile", "split-4x2"} <= set(names)
    variants, _ = tradeoffs.plan(_cfg(cpu_allocator="system"), knobs=("allocator",))
    assert [v.overrides for v in variants] == [(), (("train.cpu_allocator", "caching"),)]
    variants, skipped = tradeoffs.plan(_cfg(per_device_train_batch_size=3, gradient_accumulation_steps=3),
                                       knobs=("split",))
    assert _names(variants) == ["baseline"] and "no other split" in skipped[0]


def test_plan_knobs_subset():
    variants, _ = tradeoffs.plan(_cfg(), knobs=("precision", "lora"))
    assert _names(variants) == ["baseline", "bf16", "lora"]


def test_every_variant_validates_and_its_key_matches_what_it_expects():
    """The plan's promise ("same training" rows share the baseline's equivalence key, the others do
    not) is what the train stage will compute from the -S overrides."""
    raw = defaults.params()
    base = config.from_container(raw)
    base_key = equivalence_key(base, config.resolve(base), "fp")
    variants, _ = tradeoffs.plan(base, cuda=True, bnb_available=True)
    for v in variants:
        r = defaults.params()
        for k, val in v.overrides:
            config.apply_override(r, f"{k}={val}")
        cfg = config.from_container(r)
        key = equivalence_key(cfg, config.resolve(cfg), "fp")
        if v.expect == tradeoffs.SAME:
            assert key == base_key, v.name
        else:
            assert key != base_key or v.knob == "tf32", v.name  # tf32: same key, looser tolerance
    lora = config.from_container({**defaults.params(), "model": {**defaults.params()["model"],
                                                                  "lora": {"r": 8, "alpha": 16}}})
    r = defaults.params()
    for k, val in tradeoffs.LORA_ROW:
        config.apply_override(r, f"{k}={val}")
    assert config.from_container(r).model.lora_adapters == lora.model.lora
    # params whose model.lora is null (DVC cannot set model.lora.r there): the row gives the whole mapping
    r = defaults.params()
    r["model"]["lora"] = None
    (row,) = [v for v in tradeoffs.plan(config.from_container(r))[0] if v.knob == "lora"]
    assert row.overrides == (("model.lora", tradeoffs.LORA_MAPPING),)
    config.apply_override(r, f"model.lora={tradeoffs.LORA_MAPPING}")
    assert config.from_container(r).model.lora_adapters == lora.model.lora


def test_parse_knobs():
    assert parse_knobs(None) == tradeoffs.KNOBS
    assert parse_knobs("split, lora") == ("split", "lora")
    with pytest.raises(UserError, match="unknown foo; choose from split,checkpointing"):
        parse_knobs("split,foo")
    with pytest.raises(UserError, match="empty"):
        parse_knobs(",")


def test_cli_help_lists_the_knobs():
    assert cli.TRADEOFF_KNOBS == ",".join(tradeoffs.KNOBS)


# -- rows from runs ------------------------------------------------------------------------------

STEPS = 6


def _run(name, key="k1", step_time=1.0, first=5.0, loss_scale=1.0, examples=16, mem=(100, 100, 200, 50),
         eval_loss=1.0, params=None, device="cpu", peak=None):
    series = {"loss": [(s, (2.0 - 0.1 * s) * loss_scale) for s in range(1, STEPS + 1)],
              "grad_norm": [(s, 1.0 * loss_scale) for s in range(1, STEPS + 1)],
              "step_time_s": [(s, first if s == 1 else step_time) for s in range(1, STEPS + 1)],
              "step_examples": [(s, float(examples)) for s in range(1, STEPS + 1)]}
    metrics = {"train_runtime": first + step_time * (STEPS - 1), "eval_loss": eval_loss,
               "train_samples_per_second": examples * STEPS / (first + step_time * (STEPS - 1))}
    metrics.update(dict(zip(tradeoffs.BREAKDOWN, [m * 2**20 for m in mem])))
    if peak is not None:
        metrics["train_mem_peak_bytes"] = peak
    return RunRecord(run_id=name, name=name, params={"train.per_device_train_batch_size": "8",
                                                     "train.gradient_accumulation_steps": "2",
                                                     **(params or {})},
                     tags={"equivalence_key": key, "device": device}, metrics=metrics, series=series,
                     status="FINISHED")


def _variant(name, knob, expect=tradeoffs.SAME, overrides=(("train.x", "1"),)):
    return tradeoffs.Variant(name, knob, overrides, expect, name)


BASE = tradeoffs.Variant("baseline", "baseline", (), tradeoffs.SAME, "your params")


def test_speed_excludes_step_one_and_memory_is_the_breakdown_on_cpu():
    base = _run("baseline")
    fast = _run("split", step_time=0.5, first=30.0, mem=(100, 100, 200, 100))  # slow first step (compile)
    row = tradeoffs.measure_row(_variant("split", "split"), fast, base)
    assert row.samples_per_second == pytest.approx(32.0)  # 16 examples / 0.5 s, steps 2..6
    assert row.speedup == pytest.approx(2.0)
    assert row.first_step_s == 30.0
    assert row.memory_bytes == 500 * 2**20 and row.memory_kind == "breakdown"
    assert row.memory_ratio == pytest.approx(500 / 450)
    assert row.verdict == tradeoffs.SAME_TRAINING and row.same_training
    assert row.time_to_eval_loss_s == row.train_runtime_s  # same eval loss: reached
    assert row.notes == []
    recompiled = _run("compile", step_time=0.5, first=30.0)
    recompiled.series["step_time_s"][-1] = (STEPS, 20.0)  # the last step recompiles for its new shape
    row = tradeoffs.measure_row(_variant("compile", "compile"), recompiled, base)
    assert row.notes == [f"optimizer step {STEPS} took 20.0 s against a median 0.50 s (torch.compile recompiles "
                         "for each new batch shape; otherwise a one-off stall); its samples/s count them"]


def test_memory_on_gpu_is_the_allocator_peak():
    run = _run("b", device="NVIDIA H200", peak=3e9)
    assert tradeoffs.memory_bytes(run) == (3e9, "allocator peak")


def test_verdicts_precision_different_and_diverged():
    base = _run("baseline")
    bf16 = _run("bf16", key="k2", loss_scale=1.004, params={"train.bf16": "true"})
    row = tradeoffs.measure_row(_variant("bf16", "precision", tradeoffs.PRECISION), bf16, base)
    assert row.verdict == "same within bf16 tolerance" and not row.same_training
    far = _run("bf16", key="k2", loss_scale=1.5, params={"train.bf16": "true"})
    row = tradeoffs.measure_row(_variant("bf16", "precision", tradeoffs.PRECISION), far, base)
    assert row.verdict == "differs beyond bf16 tolerance at step 1"
    ada = _run("adafactor", key="k3", loss_scale=1.0, eval_loss=1.2)
    row = tradeoffs.measure_row(_variant("adafactor", "optimizer", tradeoffs.DIFFERENT), ada, base)
    assert row.verdict == tradeoffs.DIFFERENT_TRAINING  # another key, even with equal losses
    assert row.time_to_eval_loss_s is None  # 1.2 > 1.0: not reached
    assert tradeoffs_report._time_to_loss(row) == "not reached"
    better = _run("lora", key="k4", eval_loss=0.9)
    assert tradeoffs.measure_row(_variant("lora", "lora", tradeoffs.DIFFERENT), better, base).time_to_eval_loss_s \
        == better.metrics["train_runtime"]
    eager = _run("attn-eager", loss_scale=1.01, params={"model.attn_implementation": "eager"})
    row = tradeoffs.measure_row(_variant("attn-eager", "attention"), eager, base)
    assert row.verdict.startswith("diverged at step 1: model.attn_implementation differs")
    assert not row.same_training


def test_recommend_combines_the_faster_same_training_knobs():
    base = _run("baseline")
    runs = {"baseline": base,
            "split-16x1": _run("split-16x1", step_time=0.7, mem=(100, 100, 200, 100)),  # 1.43x
            "attn-eager": _run("attn-eager", step_time=0.9),                            # 1.11x
            "compile": _run("compile", step_time=0.98),                                 # 1.02x: noise
            "checkpointing": _run("checkpointing", step_time=1.3, mem=(100, 100, 200, 5)),
            "bf16": _run("bf16", key="k2", step_time=0.5, params={"train.bf16": "true"}),
            "adafactor": _run("adafactor", key="k3", step_time=0.5)}
    variants = [BASE,
                _variant("split-16x1", "split", overrides=(("train.per_device_train_batch_size", "16"),
                                                           ("train.gradient_accumulation_steps", "1"))),
                _variant("checkpointing", "checkpointing", overrides=(("train.gradient_checkpointing", "true"),)),
                _variant("bf16", "precision", tradeoffs.PRECISION, (("train.bf16", "true"),)),
                _variant("adafactor", "optimizer", tradeoffs.DIFFERENT, (("train.optim", "adafactor"),)),
                _variant("attn-eager", "attention", overrides=(("model.attn_implementation", "eager"),)),
                _variant("compile", "compile", overrides=(("train.torch_compile", "true"),)),
                _variant("lora", "lora", tradeoffs.DIFFERENT)]  # not run
    rows = tradeoffs.measure_rows(variants, runs)
    rec = tradeoffs.recommend(rows, budget_bytes=None)
    assert rec.variant.name == "recommended"
    assert rec.variant.overrides == (("train.per_device_train_batch_size", "16"),
                                     ("train.gradient_accumulation_steps", "1"),
                                     ("model.attn_implementation", "eager"))
    assert [r.variant.name for r in rec.parts] == ["split-16x1", "attn-eager"]
    left = dict(rec.left_out)
    assert left["compile"] == "2% faster: within run-to-run noise"
    assert left["checkpointing"] == "not faster"
    assert left["bf16"] == "same within bf16 tolerance"
    assert "adafactor" not in left and "lora" not in left  # different trainings are not candidates
    # A budget below the split's memory (500 MiB) leaves the split out: one knob stands for itself.
    rec = tradeoffs.recommend(rows, budget_bytes=480 * 2**20)
    assert rec.variant.name == "attn-eager" and dict(rec.left_out)["split-16x1"] == "over the memory budget"
    rec = tradeoffs.recommend(rows[:1] + rows[2:3], budget_bytes=None)  # baseline + checkpointing only
    assert rec.variant is None


def test_report_markdown_terminal_and_plot(tmp_path):
    base = _run("baseline")
    runs = {"baseline": base, "split-16x1": _run("split-16x1", step_time=0.7),
            "attn-eager": _run("attn-eager", step_time=0.8)}
    variants = [BASE, _variant("split-16x1", "split", overrides=(("train.per_device_train_batch_size", "16"),)),
                _variant("attn-eager", "attention", overrides=(("model.attn_implementation", "eager"),))]
    rows = tradeoffs.measure_rows(variants, runs)
    rec = tradeoffs.recommend(rows, None)
    measured = tradeoffs.measure_row(rec.variant, _run("recommended", step_time=0.6), base)
    for r in rows[1:]:
        r.notes.append("optimizer step 6 saw 4 of 16 examples")
    rows[1].notes.append("run status KILLED")
    md, png = tradeoffs_report.write(rows, rec, measured, tmp_path, "t", skipped=["tf32: a no-op on CPU"])
    text = md.read_text()
    # a note every row shares is said once; a row's own note stays with its row
    assert text.count("saw 4 of 16") == 1 and "- every row: optimizer step 6 saw 4 of 16 examples" in text
    assert "- split-16x1: run status KILLED" in text
    assert "| split-16x1 |" in text and "| recommended |" in text
    assert ("`dvc exp run -S 'train.per_device_train_batch_size=16' -S 'model.attn_implementation=eager'`"
            in text)
    assert "Measured: 1.67x the baseline's samples/s (26.67 vs 16.00)" in text
    assert "not measured: tf32: a no-op on CPU" in text
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    term = tradeoffs_report.terminal(rows, rec, measured)
    assert "split-16x1" in term and "1.43x" in term and "same training" in term


def test_dropout_masks_alone_make_a_row_same_in_expectation_and_a_candidate():
    """With dropout, another split (or attention kernel, or torch.compile) draws other masks: the losses
    differ at step 1, yet the training is the same in distribution; such a row is labelled and may be
    recommended. Without dropout the same difference is a divergence."""
    drop = {"model.dropout_max": "0.1"}
    base = _run("baseline")
    base.tags.update(drop)
    split = _run("split-16x1", step_time=0.5, loss_scale=1.01,
                 params={"train.per_device_train_batch_size": "16", "train.gradient_accumulation_steps": "1"})
    split.tags.update(drop)
    v = _variant("split-16x1", "split", overrides=(("model.dropout", "0.1"), ("train.per_device_train_batch_size", "16")))
    row = tradeoffs.measure_row(v, split, base)
    assert row.verdict == tradeoffs.IN_EXPECTATION and row.same_training
    attn = _run("attn-eager", step_time=0.8, loss_scale=1.01, params={"model.attn_implementation": "eager"})
    attn.tags.update(drop)
    va = _variant("attn-eager", "attention", overrides=(("model.dropout", "0.1"), ("model.attn_implementation", "eager")))
    arow = tradeoffs.measure_row(va, attn, base)
    assert arow.verdict == tradeoffs.IN_EXPECTATION
    rec = tradeoffs.recommend([tradeoffs.measure_row(BASE, base, base), row, arow], None)
    # the shared -S (model.dropout) once, then each knob's own
    assert rec.variant.overrides == (("model.dropout", "0.1"), ("train.per_device_train_batch_size", "16"),
                                     ("model.attn_implementation", "eager"))
    nodrop = _run("split-16x1", step_time=0.5, loss_scale=1.01,
                  params={"train.per_device_train_batch_size": "16", "train.gradient_accumulation_steps": "1"})
    row = tradeoffs.measure_row(v, nodrop, _run("baseline"))
    assert row.verdict.startswith("diverged at step 1") and not row.same_training


def test_common_overrides_go_first_in_every_variant():
    variants, _ = tradeoffs.plan(_cfg(), knobs=("split",))
    out = tradeoffs.with_overrides(variants, [("model.dropout", "0")])
    assert [v.overrides for v in out] == [
        (("model.dropout", "0"),),
        (("model.dropout", "0"), ("train.per_device_train_batch_size", "16"), ("train.gradient_accumulation_steps", "1"))]


def test_run_queue_waits_for_its_experiments_to_leave_the_queue(monkeypatch, capsys):
    """`dvc exp run --run-all` can return at once while a worker left from an earlier call runs the task
    just queued: the report then found no run for it (seen: the combined recommendation 'not run')."""
    from onegpu.stages import tradeoffs as stage
    states = [["tradeoffs-1-recommended", "other"], ["tradeoffs-1-recommended"], []]
    monkeypatch.setattr(stage, "_other_queued", lambda: states.pop(0))
    monkeypatch.setattr(stage.subprocess, "run", lambda *a, **k: None)  # run-all returns at once
    monkeypatch.setattr(stage.time, "sleep", lambda s: None)
    stage._run_queue({"tradeoffs-1-recommended"})
    assert states == []  # polled until its experiment left the queue
    assert "waiting for tradeoffs-1-recommended (still in the DVC queue)" in capsys.readouterr().out


@pytest.mark.parametrize("differs", [True, False])
def test_start_says_when_the_baseline_params_differ_from_git(monkeypatch, capsys, fresh_root, differs):
    """A workspace `dvc exp run -S` (the README's `auto` example) leaves its values in params.yaml; the
    baseline is then that file, and the command says so."""
    from onegpu import paths
    from onegpu.stages import tradeoffs as stage
    monkeypatch.setattr(stage, "_queue", lambda prefix, variants: None)
    monkeypatch.setattr(paths, "params_differ_from_head", lambda params: differs)
    defaults.write_params(Path.cwd())
    stage._start(_cfg(), "params.yaml", ("split",), [], queue_only=True)
    out = capsys.readouterr().out
    assert ("note: params.yaml differs from git's HEAD (`git diff params.yaml`): the baseline is the file "
            "as it is" in out) == differs, out
