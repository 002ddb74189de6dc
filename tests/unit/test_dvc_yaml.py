"""dvc.yaml lists, for each stage, every file the stage reads: its code (the stage module and every onegpu
module it imports, also lazily or by name) and, through the inputs stage, the data and model that
params.yaml names."""
from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from tests.unit.import_graph import imports, module_file

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def code_read_by(stage: str, packages: bool = True) -> set[str]:
    """Repo-relative paths of the onegpu source files ``onegpu <stage>`` can import: a module's imports and
    (``packages``) its packages' (importing ``onegpu.training.objectives.precomputed`` runs
    ``onegpu/training/objectives/__init__`` first, and what that imports). Without ``packages``: the modules
    the stage's code names, the ones whose functions it can call."""
    seen, todo = set(), [f"onegpu.stages.{stage}"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += imports(module_file(m))
            if packages:
                todo += [".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)]
    return {module_file(m).relative_to(REPO).as_posix() for m in seen if module_file(m).name != "__init__.py"}


@pytest.mark.parametrize("stage", ["inputs", "prepare", "reference", "train", "evaluate"])
def test_code_deps_match_what_the_stage_imports(stage):
    deps = [d for d in STAGES[stage]["deps"] if d.startswith("src/")]
    code = code_read_by(stage)
    covered = {f for f in code if any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps)}
    assert code - covered == set(), f"{stage} imports these but dvc.yaml does not list them"
    stray = [d for d in deps if not any(f == d or f.startswith(d.rstrip("/") + "/") for f in code)]
    assert stray == [], f"{stage} lists these but never imports them"


def test_a_stages_code_includes_what_its_packages_import():
    """Importing a module runs its packages' ``__init__`` first: the reference stage imports
    ``objectives.precomputed`` by name, and ``objectives/__init__`` brings the registry and every objective
    with it (data/chat.py likewise brings the whole ``data`` package), so dvc.yaml must list them too."""
    named, loaded = code_read_by("reference", packages=False), code_read_by("reference")
    assert "src/onegpu/training/objectives/registry.py" in loaded - named
    assert "src/onegpu/data/splits.py" in loaded - named


def test_stages_that_read_params_named_inputs_depend_on_their_links():
    """No stage is always changed (`dvc status` would never say up to date); the inputs stage's links are
    persistent, uncached outs (DVC neither deletes nor caches what they point to), one per param."""
    from onegpu import inputs
    assert not any(s.get("always_changed") for s in STAGES.values())
    links = {str(inputs.DATA_LINK), str(inputs.MODEL_LINK)}
    assert STAGES["inputs"]["outs"] == [{link: {"cache": False, "persist": True}} for link in sorted(links)]
    assert set(STAGES["inputs"]["params"]) == {"data.source", "model.name_or_path"}
    # prepare reads the data and the model's tokenizer; train reads the model's weights.
    assert links <= set(STAGES["prepare"]["deps"])
    assert str(inputs.MODEL_LINK) in STAGES["train"]["deps"]
    assert "/inputs/" in (REPO / "data" / ".gitignore").read_text().splitlines()  # machine-specific links
    assert {"data/processed", "models"} <= set(STAGES["evaluate"]["deps"])


def test_step_plots_show_loss_memory_and_speed_with_a_dash_pattern_per_experiment():
    """Issue 20 item 8: `dvc plots diff` of equal runs drew one line for three legend entries (equal
    values lie on one another; DVC's linear template tells revisions apart by colour only) and had no
    memory or speed plot. Each step plot is a column train writes, drawn with .dvc/plots/steps.json,
    whose dash pattern, like the colour, follows the revision."""
    import json

    from onegpu.stages.train import STEP_COLUMNS
    plots = yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"]
    steps = {name: p for d in plots for name, p in d.items() if "plots/train_steps.csv" in (p.get("y") or {})}
    assert sorted(p["y"]["plots/train_steps.csv"] for p in steps.values()) == ["loss", "mem_peak_mib",
                                                                              "samples_per_second"]
    assert all(p["template"] == "steps" and p["y"]["plots/train_steps.csv"] in STEP_COLUMNS for p in steps.values())
    template = json.loads((REPO / ".dvc/plots/steps.json").read_text())
    dash = template["encoding"]["strokeDash"]
    assert dash["field"] == "rev" and len({str(r) for r in dash["scale"]["range"]}) >= 4
    assert template["encoding"]["color"] == "<DVC_METRIC_COLOR>"  # DVC fills the colour per revision


# --- params: the config keys each stage's code reads --------------------------------------------------------

def _dataclass_in(hint) -> type | None:
    """The dataclass in a field's type hint (``LoraConfig | None`` -> ``LoraConfig``), else None."""
    for t in (hint, *typing.get_args(hint)):
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            return t
    return None


def _schema() -> dict[tuple[str, ...], type]:
    """params.yaml's dataclasses by path: ``()`` Config, ``("data",)`` DataConfig, ``("model", "lora")``..."""
    from onegpu.config import Config
    out, todo = {}, [((), Config)]
    while todo:
        path, cls = todo.pop()
        out[path] = cls
        todo += [((*path, k), sub) for k, hint in typing.get_type_hints(cls).items()
                 if (sub := _dataclass_in(hint)) is not None]
    return out


SCHEMA = _schema()
CONFIG_NAMES = {"cfg", "config"}  # a name or attribute so called holds the whole Config (cfg, self.cfg, req.cfg)


class _Module:
    """One onegpu module's AST: its functions by name, the onegpu modules and names it imports."""

    def __init__(self, name: str, source: str | None = None) -> None:
        self.name, self.tree = name, ast.parse(module_file(name).read_text() if source is None else source)
        self.functions = {n.name: n for n in self.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.imports: dict[str, str] = {}  # local name -> "onegpu.mod" (a module) or "onegpu.mod:name"
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("onegpu"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    self.imports[a.asname or a.name] = sub if module_file(sub).is_file() else f"{node.module}:{a.name}"
            elif isinstance(node, ast.Import):
                self.imports |= {a.asname: a.name for a in node.names if a.asname and a.name.startswith("onegpu.")}
        self.parents = {c: p for p in ast.walk(self.tree) for c in ast.iter_child_nodes(p)}


_MODULES: dict[str, _Module] = {}


def _module(name: str) -> _Module:
    if name not in _MODULES:
        _MODULES[name] = _Module(name)
    return _MODULES[name]


def _function(module: str, name: str, depth: int = 0) -> tuple[_Module, ast.FunctionDef] | None:
    """The onegpu function ``name`` of ``module`` (defined there, or imported into it), else None."""
    m = _module(module)
    if name in m.functions:
        return m, m.functions[name]
    target = m.imports.get(name, "")
    if ":" in target and depth < 5:
        return _function(*target.split(":"), depth + 1)
    return None


def _callee(call: ast.Call, m: _Module) -> tuple[_Module, ast.FunctionDef] | None:
    """The onegpu function a call calls: ``f(...)`` or ``module.f(...)``, when the test can tell."""
    f = call.func
    if isinstance(f, ast.Name):
        return _function(m.name, f.id)
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and ":" not in m.imports.get(f.value.id, ":"):
        return _function(m.imports[f.value.id], f.attr)
    return None


def _path(node: ast.AST, env: dict) -> tuple[str, ...] | None:
    """The schema path ``node`` evaluates to: a section (``("train",)``), a mapping in one, a key
    (``("data", "packing")``) or the whole Config (``()``); None for anything else."""
    if isinstance(node, ast.Name):
        return env.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _path(node.value, env)
        if base is None:
            return () if node.attr in CONFIG_NAMES else None
        cls = SCHEMA.get(base)
        if cls is not None and node.attr in {f.name for f in dataclasses.fields(cls)}:
            return (*base, node.attr)
    return None


def _env(fn: ast.AST, bound: dict) -> dict:
    """The names holding config values in ``fn``: ``cfg`` and ``config`` (the whole Config) unless a
    parameter or assignment shadows them, a parameter annotated ``Config``, ``bound`` (the caller's
    arguments), and names assigned a config value (``t = cfg.train``; ``a, b = cfg.data, cfg.model``)."""
    env = {n: () for n in CONFIG_NAMES}
    args = getattr(fn, "args", None)
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if args else []:
        env.pop(a.arg, None)
        if a.annotation is not None and re.search(r"\bConfig\b", ast.unparse(a.annotation)):
            env[a.arg] = ()
        elif a.annotation is None and a.arg in CONFIG_NAMES:
            env[a.arg] = ()
    env |= bound
    for node in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts))
            for t, v in pairs:
                if isinstance(t, ast.Name):
                    if (p := _path(v, env)) in SCHEMA:
                        env[t.id] = p
                    else:
                        env.pop(t.id, None)
    return env


def _bind(call: ast.Call, fn: ast.FunctionDef, env: dict) -> dict[str, tuple[ast.AST, tuple[str, ...]]]:
    """``fn``'s parameters that ``call`` passes a config value to: the argument and its path."""
    params = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
    named = {a.arg for a in [*fn.args.args, *fn.args.kwonlyargs]}
    pairs = [(p, a) for p, a in zip(params, call.args) if not isinstance(a, ast.Starred)]
    pairs += [(k.arg, k.value) for k in call.keywords if k.arg in named]
    return {p: (a, path) for p, a in pairs if (path := _path(a, env)) in SCHEMA}


def _property(path: tuple[str, ...], attr: str) -> ast.FunctionDef | None:
    """The body of property ``attr`` of the schema class at ``path`` (``ModelConfig.lora_adapters``)."""
    cls = SCHEMA.get(path)
    if cls is None or not isinstance(getattr(cls, attr, None), property):
        return None
    section = _module(cls.__module__)  # the section's module of the config package
    body = next(n for n in section.tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    return next(n for n in body.body if isinstance(n, ast.FunctionDef) and n.name == attr)


def _reads(m: _Module, fn: ast.AST, bound: dict, seen: set) -> set[str]:
    """Dotted params keys that ``fn`` (a function, or a module's top-level code) reads, following the
    config values it hands to other onegpu functions; ``seen`` stops a recursion and holds the modules
    not to follow into (CHECKS_ONLY)."""
    key = (m.name, id(fn), tuple(sorted(bound.items())))
    if key in seen or m.name in seen:
        return set()
    seen.add(key)
    env, out = _env(fn, bound), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and (base := _path(node.value, env)) is not None:
            if (prop := _property(base, node.attr)) is not None:
                out |= _reads(_module(SCHEMA[base].__module__), prop, {"self": base}, seen)
        path = _path(node, env) if isinstance(getattr(node, "ctx", None), ast.Load) else None
        if path is None:
            continue
        if path not in SCHEMA:
            out.add(".".join(path))  # a key
            continue
        parent = m.parents.get(node)
        if isinstance(parent, ast.Attribute) or _assigned(node, parent, m):
            continue  # a step of a longer chain, or an alias (_env)
        call = m.parents.get(parent) if isinstance(parent, ast.keyword) else parent
        f = _callee(call, m) if isinstance(call, ast.Call) and node is not call.func else None
        bound = _bind(call, f[1], env) if f else {}
        if any(a is node for a, _ in bound.values()):
            out |= _reads(*f, {p: path for p, (_, path) in bound.items()}, seen)
        elif path:  # the whole Config handed on is not followed further (serialised, copied, or named cfg)
            out.add(".".join(path))  # a section handed to code the test cannot follow: all of it
    return out


def _assigned(node: ast.AST, parent: ast.AST, m: _Module) -> bool:
    """True when ``node`` is the value assigned to names (``t = cfg.train``), or its place's in a tuple
    assigned to a tuple of names (``d, task = cfg.data, ...``): the aliases :func:`_env` follows."""
    if not isinstance(parent, ast.Tuple):
        return isinstance(parent, ast.Assign) and parent.value is node and all(
            isinstance(t, ast.Name) for t in parent.targets)
    tup, at, parent = parent, parent.elts.index(node), m.parents.get(parent)
    return isinstance(parent, ast.Assign) and parent.value is tup and all(
        isinstance(t, ast.Tuple) and len(t.elts) == len(tup.elts) and isinstance(t.elts[at], ast.Name)
        for t in parent.targets)


# Modules a stage imports only to check params, not to compute its outs: inputs checks the data's columns and
# form (data.check_input, which reads data.text_column, model.task, ...) before it links data.source and
# model.name_or_path; prepare, which declares every key checked there, checks them again and uses them.
CHECKS_ONLY = {"inputs": {"onegpu.data.check"}}


def _module_reads(m: _Module, seen: set) -> set[str]:
    """What every function of ``m`` and its top-level code read (:func:`_reads`)."""
    top = ast.Module(body=[s for s in m.tree.body if not isinstance(s, (ast.FunctionDef, ast.ClassDef))],
                     type_ignores=[])
    fns = [top, *(n for n in ast.walk(m.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    return set().union(*(_reads(m, fn, {}, seen) for fn in fns))


def params_read_by(stage: str) -> set[str]:
    """Dotted params keys that ``stage``'s code reads (the rule: test_each_stage_declares_every_param_...)."""
    out, seen = set(), set(CHECKS_ONLY.get(stage, ()))
    for path in sorted(p for p in code_read_by(stage, packages=False) if not p.startswith("src/onegpu/config/")):
        out |= _module_reads(_module(".".join(Path(path).relative_to("src").with_suffix("").parts)), seen)
    return out


@pytest.mark.parametrize("stage", ["inputs", "prepare", "reference", "train", "evaluate"])
def test_each_stage_declares_every_param_its_code_reads(stage):
    """Issue 31: train's collator reads data.padding_free and data.packing, but dvc.yaml declared them for
    prepare only, so `dvc exp run -S data.padding_free=true` re-ran prepare (the same output) and not train:
    the experiment showed the old training under the new value. A key ``s.k`` is declared by ``s.k`` or ``s``.

    What a stage reads, over the modules of the code-deps test (the stage's and every onegpu module it
    imports): in any function of those modules,

    - a chain of attributes down params.yaml's schema from a config value reads the key it ends at
      (``cfg.data.packing``, ``self.cfg.train.seed``, ``req.cfg.model.task``); a property reads what its
      body reads (``cfg.model.lora_adapters``: model.lora, model.lora.r);
    - config values are: a name or attribute called ``cfg`` or ``config`` (unless shadowed), a parameter
      annotated ``Config``, a name assigned one (``t = cfg.train``; ``d, task = cfg.data, cfg.model.task``),
      and the parameter of an onegpu function that a section is passed to, by position or keyword
      (``loader.build_causal_lm(path, tokenizer, cfg.model, ...)``: its ``sizes.n_layer`` reads model.n_layer);
    - a section used any other way (handed to code outside onegpu or that this test does not follow, such
      as ``getattr(t, name)``, ``replace(cfg.train, ...)`` or a method; compared; returned) reads all of it.

    Not reads: the config package's own functions, unless the stage's code calls them (``resolve(cfg)``): every stage
    validates every section when it loads params.yaml, and a bad value stops it without changing any
    output; the whole config handed to code outside onegpu, which serialises it for the record
    (``flatten(cfg.to_dict())``: MLflow params, the equivalence key, the resume hash: they name a run, they
    do not change it) or keeps it (``TrainRequest(cfg=cfg)``, read back as ``req.cfg`` above); modules in
    :data:`CHECKS_ONLY`.
    The rule over-reads rather than misses: a module counts whole, as in the code deps (evaluate imports
    training/objectives/batches.py for its collator, so declares what the training rows there read as well).
    """
    declared = STAGES[stage].get("params", [])
    read = params_read_by(stage)
    missing = sorted(k for k in read if not any(k == p or k.startswith(p + ".") for p in declared))
    assert not missing, f"{stage}'s code reads these params but dvc.yaml does not declare them: {missing}"


SAMPLE = """
from onegpu.config import Config, DataConfig
from onegpu.data import check_source


def build(model_cfg, max_length):
    return model_cfg.n_layer * max_length


class Loop:
    def step(self):
        return self.cfg.train.seed


def run(c: Config, req, config: DataConfig):
    t = c.train
    d, m = c.data, c.model
    build(max_length=c.data.max_length, model_cfg=c.model)
    check_source(DataConfig(source="x"))
    req.kept = c.tracking  # not an alias this test follows: all of it
    if d.packing and req.cfg.data.padding_free and m.lora_adapters and config.seed:
        return t.optim, c.to_dict()
    return getattr(c.evaluate, "x"), cfg.tracking.experiment_name
"""


def test_the_params_rule_follows_aliases_calls_and_properties():
    """:func:`params_read_by`'s rule on the patterns the code base uses (a parameter annotated with a
    section class is followed from its callers only: ``config.seed`` above reads nothing)."""
    _MODULES["onegpu.sample"] = _Module("onegpu.sample", SAMPLE)
    try:
        assert _module_reads(_MODULES["onegpu.sample"], set()) == {
            "model.n_layer", "train.seed", "data.max_length", "data.packing", "data.padding_free",
            "model.lora", "model.lora.r", "train.optim", "evaluate", "tracking", "tracking.experiment_name"}
    finally:
        del _MODULES["onegpu.sample"]
