"""The plan of onegpu tradeoffs: one small function per knob (onegpu.tradeoffs.knobs), parse_knobs, --help."""
from __future__ import annotations

import pytest

from onegpu import config
from onegpu.equivalence import equivalence_key
from onegpu.errors import UserError
from onegpu.tradeoffs import knobs
from onegpu.tradeoffs.knobs import parse_knobs
from tests import defaults

CPU = config.DeviceFacts()


def _cfg(**train) -> config.Config:
    raw = defaults.params()
    raw["train"].update(train)
    return config.from_container(raw)


def _names(variants):
    return [v.name for v in variants]


def test_plan_on_cpu_for_the_defaults():
    variants, skipped = knobs.plan(_cfg(), CPU)
    assert _names(variants) == ["baseline", "split-16x1", "checkpointing", "bf16", "adamw_torch_fused", "adafactor",
                                "attn-eager", "cpu-allocator-system", "lora"]
    by = {v.name: v for v in variants}
    assert by["split-16x1"].set_args == ["-S", "train.per_device_train_batch_size=16",
                                         "-S", "train.gradient_accumulation_steps=1"]
    assert by["baseline"].set_args == []
    assert by["lora"].set_args == ["-S", "model.lora.r=8"]  # the dotted form a user types
    # tf32: a no-op on CPU; padding-free, packing and the fused LM head: causal LM only
    # compile: on a CPU only when --knobs names it (its step compiles C++ kernels first)
    assert [s.split(":")[0] for s in skipped] == ["tf32", "compile", "padding_free", "packing", "fused_lm_head",
                                                  "activation_offloading", "reference", "sharding"]
    assert skipped[1].startswith("compile: compile left out on a CPU unless --knobs names compile (the step compiles")


def test_rows_whose_step_compiles_run_on_a_cpu_only_when_their_knob_is_named():
    """On a CPU the default set leaves out torch.compile and torchao's low-bit AdamW and says so; naming the
    knob (or a GPU) plans them; the row that turns compiling off compiles nothing and stays."""
    cpu = config.DeviceFacts(packages=frozenset({"torchao"}))
    variants, skipped = knobs.plan(_cfg(), cpu)
    assert not {"compile", "adamw_torch_8bit", "adamw_torch_4bit"} & set(_names(variants))
    assert "adamw_torch_fused" in _names(variants) and "adafactor" in _names(variants)
    assert [s for s in skipped if s.startswith(("optimizer", "compile"))] == [
        "optimizer: adamw_torch_8bit, adamw_torch_4bit left out on a CPU unless --knobs names optimizer (the step "
        "compiles C++ kernels first: tens of seconds the first time in an environment)",
        "compile: compile left out on a CPU unless --knobs names compile (the step compiles C++ kernels first: "
        "tens of seconds the first time in an environment)"]
    named, skipped = knobs.plan(_cfg(), cpu, knobs=("optimizer", "compile"))
    assert _names(named) == ["baseline", "adamw_torch_fused", "adafactor", "adamw_torch_8bit", "adamw_torch_4bit",
                             "compile"] and skipped == []
    gpu = config.DeviceFacts(cuda=True, gpus=1, bf16=True, packages=frozenset({"torchao"}))
    assert {"compile", "adamw_torch_8bit", "adamw_torch_4bit"} <= set(_names(knobs.plan(_cfg(), gpu)[0]))
    assert "no-compile" in _names(knobs.plan(_cfg(torch_compile=True), cpu)[0])


def test_plan_on_cuda_adds_tf32_fp16_and_8bit():
    facts = config.DeviceFacts(cuda=True, gpus=1, bf16=False, packages=frozenset({"bitsandbytes"}))
    variants, skipped = knobs.plan(_cfg(), facts)
    names = _names(variants)
    assert "fp16" in names and "bf16" not in names  # a GPU without bf16
    assert "tf32" in names and "adamw_bnb_8bit" in names and "cpu-allocator-system" not in names
    assert "offloading" in names and next(v for v in variants if v.name == "offloading").expect == knobs.SAME
    # host memory is not the tensors' on a GPU
    assert [s.split(":")[0] for s in skipped] == ["allocator", "padding_free", "packing", "fused_lm_head",
                                                  "reference", "sharding"]


def test_torchao_adds_8bit_and_4bit_adamw_where_bitsandbytes_is_not_usable():
    """On a CPU with torchao: its 8-bit and 4-bit AdamW, each another training (another equivalence key);
    on CUDA with bitsandbytes the 8-bit row is bitsandbytes' and torchao adds only its 4-bit one."""
    raw = defaults.params()
    base = config.from_container(raw)
    cpu = config.DeviceFacts(packages=frozenset({"torchao"}))
    rows = [v for v in knobs.plan(base, cpu, knobs=("optimizer",))[0] if "bit" in v.name]
    assert [(v.name, v.overrides, v.expect) for v in rows] == [
        ("adamw_torch_8bit", (("train.optim", "adamw_torch_8bit"),), knobs.DIFFERENT),
        ("adamw_torch_4bit", (("train.optim", "adamw_torch_4bit"),), knobs.DIFFERENT)]
    keys = set()
    for v in rows:
        r = defaults.params()
        for k, val in v.overrides:
            config.apply_override(r, f"{k}={val}")
        cfg = config.from_container(r)
        config.check_device(cfg, cpu)  # the row runs on this machine
        keys.add(equivalence_key(cfg, config.resolve(cfg), "fp"))
    assert len(keys) == 2 and equivalence_key(base, config.resolve(base), "fp") not in keys
    gpu = config.DeviceFacts(cuda=True, gpus=1, packages=frozenset({"bitsandbytes", "torchao"}))
    assert [v.name for v in knobs.optimizer(base, gpu) if "bit" in v.name] == ["adamw_bnb_8bit", "adamw_torch_4bit"]
    assert [v.name for v in knobs.optimizer(_cfg(optim="adamw_torch_8bit"), cpu) if "bit" in v.name] == [
        "adamw_torch_4bit"]


def test_plan_turns_off_what_is_on_and_splits_the_other_way():
    variants, skipped = knobs.plan(_cfg(gradient_checkpointing=True, bf16=True, torch_compile=True,
                                            per_device_train_batch_size=8, gradient_accumulation_steps=1), CPU)
    names = _names(variants)
    assert {"no-checkpointing", "fp32", "no-compile", "split-4x2"} <= set(names)
    variants, _ = knobs.plan(_cfg(cpu_allocator="system"), CPU, knobs=("allocator",))
    assert [v.overrides for v in variants] == [(), (("train.cpu_allocator", "caching"),)]
    variants, skipped = knobs.plan(_cfg(per_device_train_batch_size=3, gradient_accumulation_steps=3), CPU,
                                       knobs=("split",))
    assert _names(variants) == ["baseline"] and "no other split" in skipped[0]


def test_plan_knobs_subset():
    variants, _ = knobs.plan(_cfg(), CPU, knobs=("precision", "lora"))
    assert _names(variants) == ["baseline", "bf16", "lora"]


def test_every_variant_validates_and_its_key_matches_what_it_expects():
    """The plan's promise ("same training" rows share the baseline's equivalence key, the others do
    not) is what the train stage will compute from the -S overrides."""
    raw = defaults.params()
    base = config.from_container(raw)
    base_key = equivalence_key(base, config.resolve(base), "fp")
    facts = config.DeviceFacts(cuda=True, gpus=1, bf16=True, packages=frozenset({"bitsandbytes"}))
    variants, _ = knobs.plan(base, facts)
    for v in variants:
        r = defaults.params()
        for k, val in v.overrides:
            config.apply_override(r, f"{k}={val}")
        cfg = config.from_container(r)
        key = equivalence_key(cfg, config.resolve(cfg), "fp")
        if v.expect == knobs.SAME:
            assert key == base_key, v.name
        else:
            assert key != base_key or v.knob == "tf32", v.name  # tf32: same key, looser tolerance
    lora = config.from_container({**defaults.params(), "model": {**defaults.params()["model"],
                                                                  "lora": {"r": 8, "alpha": 16}}})
    r = defaults.params()
    for k, val in knobs.LORA_ROW:
        config.apply_override(r, f"{k}={val}")
    assert config.from_container(r).model.lora_adapters == lora.model.lora
    # params whose model.lora is null (DVC cannot set model.lora.r there): the row gives the whole mapping
    r = defaults.params()
    r["model"]["lora"] = None
    (row,) = [v for v in knobs.plan(config.from_container(r), CPU)[0] if v.knob == "lora"]
    assert row.overrides == (("model.lora", knobs.LORA_MAPPING),)
    config.apply_override(r, f"model.lora={knobs.LORA_MAPPING}")
    assert config.from_container(r).model.lora_adapters == lora.model.lora


def test_parse_knobs():
    assert parse_knobs(None) is None  # the default set: knobs.plan's
    assert parse_knobs("split, lora") == ("split", "lora")
    with pytest.raises(UserError, match="unknown foo; choose from split,checkpointing"):
        parse_knobs("split,foo")
    with pytest.raises(UserError, match="empty"):
        parse_knobs(",")


def test_cli_help_lists_the_knobs_without_importing_a_heavy_library():
    import subprocess
    import sys
    code = ("import sys, contextlib, io; from onegpu import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try: cli.main(['tradeoffs', '--help'])\n"
            "    except SystemExit: pass\n"
            "print(out.getvalue()); print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'transformers', 'mlflow', 'numpy', 'omegaconf', 'dvc'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert ",".join(knobs.KNOBS) in "".join(out.split())  # argparse wraps (and cuts) the help text
    assert out.strip().endswith("[]")  # nothing heavy imported to print --help


def test_common_overrides_go_first_in_every_variant():
    variants, _ = knobs.plan(_cfg(), CPU, knobs=("split",))
    out = knobs.with_overrides(variants, [("model.dropout", "0")])
    assert [v.overrides for v in out] == [
        (("model.dropout", "0"),),
        (("model.dropout", "0"), ("train.per_device_train_batch_size", "16"),
         ("train.gradient_accumulation_steps", "1"))]


def _sft(**data) -> config.Config:
    raw = defaults.params()
    raw["model"].update(task="causal-lm", name_or_path=None)
    raw["data"].update(source="bbcnews-headlines", **data)
    return config.from_container(raw)


def test_padding_free_and_packing_rows_only_for_a_causal_lm_and_their_keys():
    """Padding-free is the same training (the baseline's key); packing another (its own key); a
    classifier gets neither row, with the reason."""
    variants, skipped = knobs.plan(_cfg(), CPU, knobs=("padding_free", "packing"))
    assert _names(variants) == ["baseline"]
    assert [s.split(":")[0] for s in skipped] == ["padding_free", "packing"] and "causal LM" in skipped[0]
    base = _sft()
    variants, _ = knobs.plan(base, CPU, knobs=("padding_free", "packing"))
    assert [(v.name, v.overrides, v.expect) for v in variants[1:]] == [
        ("padding-free", (("data.padding_free", "true"),), knobs.SAME),
        ("packing", (("data.packing", "true"),), knobs.DIFFERENT)]
    base_key = equivalence_key(base, config.resolve(base), "fp")
    for v in variants[1:]:
        cfg = _sft(**{k.split(".")[1]: val == "true" for k, val in v.overrides})
        assert (equivalence_key(cfg, config.resolve(cfg), "fp") == base_key) == (v.expect == knobs.SAME), v.name
    # padding-free on: the row turns it off; packing on: padding-free has no row (packed rows are flat already)
    assert _names(knobs.plan(_sft(padding_free=True), CPU, knobs=("padding_free",))[0]) == ["baseline",
                                                                                           "no-padding-free"]
    _, skipped = knobs.plan(_sft(packing=True), CPU, knobs=("padding_free", "packing"))
    assert [s.split(":")[0] for s in skipped] == ["padding_free"]


def test_the_fused_lm_head_row_only_for_a_causal_lm_and_the_baselines_key():
    """The fused LM head is the same training (the baseline's key), turned off when on (the default) and on
    when off; a classifier gets no row, with the reason."""
    _, skipped = knobs.plan(_cfg(), CPU, knobs=("fused_lm_head",))
    assert len(skipped) == 1 and skipped[0].startswith("fused_lm_head: causal LM only")
    base = _sft()
    variants, _ = knobs.plan(base, CPU, knobs=("fused_lm_head",))
    assert [(v.name, v.overrides, v.expect) for v in variants[1:]] == [
        ("no-fused-lm-head", (("train.fused_lm_head", "false"),), knobs.SAME)]
    off = config.from_container({**base.to_dict(), "train": {**base.to_dict()["train"], "fused_lm_head": False}})
    assert equivalence_key(off, config.resolve(off), "fp") == equivalence_key(base, config.resolve(base), "fp")
    assert _names(knobs.plan(off, CPU, knobs=("fused_lm_head",))[0]) == ["baseline", "fused-lm-head"]


def test_the_reference_row_only_for_preference_tuning_and_the_baselines_key():
    """DPO's reference scored once (train.dpo.precompute_ref_log_probs) is the same training as a live one
    (the baseline's key), turned on when off and off when on; a task without a reference gets no row, with
    the reason."""
    _, skipped = knobs.plan(_sft(), CPU, knobs=("reference",))
    assert skipped == ["reference: preference tuning (DPO) only: model.task causal-lm has no reference model"]
    raw = _sft().to_dict()
    raw["model"]["task"], raw["data"]["source"] = "preference", "bbcnews-headline-pairs"
    base = config.from_container(raw)
    variants, _ = knobs.plan(base, CPU, knobs=("reference",))
    assert [(v.name, v.overrides, v.expect) for v in variants[1:]] == [
        ("precomputed-reference", (("train.dpo.precompute_ref_log_probs", "true"),), knobs.SAME)]
    config.apply_override(raw, "train.dpo.precompute_ref_log_probs=true")
    on = config.from_container(raw)
    assert equivalence_key(on, config.resolve(on), "fp") == equivalence_key(base, config.resolve(base), "fp")
    assert _names(knobs.plan(on, CPU, knobs=("reference",))[0]) == ["baseline", "no-precomputed-reference"]


def _processes(**train) -> dict:
    """The defaults' params on 2 processes, with what FSDP2 refuses switched off (and ``train`` on top)."""
    raw = defaults.params()
    raw["train"].update({"num_processes": 2, "eval_strategy": "no", "oom_retry": False, **train})
    return raw


def test_the_sharding_row_toggles_fsdp_on_the_accelerate_backend_with_the_baselines_key():
    """Over 2 or more processes: one row turning FSDP2 on (with train.backend=accelerate under the trainer
    backend) or off; it validates and has the baseline's equivalence key, as SAME promises."""
    for backend, extra in (("trainer", (("train.backend", "accelerate"),)), ("accelerate", ())):
        raw = _processes(backend=backend)
        base = config.from_container(raw)
        (row,) = knobs.sharding(base, CPU)
        assert (row.name, row.knob, row.overrides, row.expect) == (
            "sharding", "sharding", (*extra, ("train.fsdp.enabled", "true")), knobs.SAME)
        assert "FSDP2 sharding over 2 processes" in row.what
        for k, val in row.overrides:
            config.apply_override(raw, f"{k}={val}")
        cfg = config.from_container(raw)
        assert cfg.train.fsdp.enabled and cfg.train.backend == "accelerate"
        assert equivalence_key(cfg, config.resolve(cfg), "fp") == equivalence_key(base, config.resolve(base), "fp")
        (back,) = knobs.sharding(cfg, CPU)  # sharded params: the row turns it off
        assert (back.name, back.overrides, back.expect) == ("no-sharding", (("train.fsdp.enabled", "false"),),
                                                            knobs.SAME)
    variants, skipped = knobs.plan(config.from_container(_processes()), CPU)
    assert "sharding" in _names(variants) and not [s for s in skipped if s.startswith("sharding")]
    (row,) = knobs.sharding(config.from_container(_processes(oom_retry=True)), CPU)  # the defaults' retry: off
    assert row.overrides == (("train.backend", "accelerate"), ("train.oom_retry", "false"),
                             ("train.fsdp.enabled", "true")) and row.what.endswith(", no oom_retry)")


def test_no_sharding_row_on_one_process_or_where_validation_would_refuse_it():
    _, skipped = knobs.plan(_cfg(), CPU, knobs=("sharding",))
    assert skipped == ["sharding: FSDP2 shards over processes and train.num_processes is 1; set "
                       "train.num_processes to 2 or more (on a CPU gloo processes count)"]
    for train, key in (({"torch_compile": True}, "train.torch_compile"), ({"fp16": True}, "train.fp16")):
        raw = _processes(**train)
        variants, skipped = knobs.plan(config.from_container(raw), CPU, knobs=("sharding",))
        assert _names(variants) == ["baseline"]
        assert skipped[0].startswith(f"sharding: the row's params: train.fsdp.enabled: is true with {key}: "), skipped
        assert skipped[0].endswith("(`onegpu tradeoffs -S key=value` sets a key for every row)")
    raw = _processes()
    raw["model"]["task"], raw["model"]["name_or_path"], raw["data"]["source"] = "causal-lm", None, "bbcnews-headlines"
    (row,) = knobs.sharding(config.from_container(raw), CPU)  # a causal LM's fused head (the default) shards too
    assert row.name == "sharding" and config.from_container(raw).train.fused_lm_head
