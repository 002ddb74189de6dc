"""Suite-wide isolation from the user's machine state.

- Per-user caches (``~/.cache/onegpu``: the measured CPU peak FLOP/s, the packaged chat model converted
  from its GGUF) go to a folder of this test run, shared by its xdist workers: a test never reads a
  figure or a model the user's own runs cached, nor leaves one behind. Set before any
  ``onegpu`` module is imported, since modules resolve their cache paths at import.
- Each test starts in an empty folder of its own, so nothing can pick up the workspace's
  ``params.yaml`` or ``mlflow.db`` through the current directory; MLflow and DVC variables of the
  calling shell are cleared.

Parallel runs (``make test``: pytest-xdist, ``--dist loadfile``, two workers per core plus one, at most 5;
tests/README.md, "Keeping the suite fast"):

- each worker's PyTorch gets its share of the cores (``OMP_NUM_THREADS``, inherited by the stages the
  integration tests start): two workers of two threads each on two cores stall every parallel op on a
  descheduled thread (measured: 3.4 s instead of 0.36 s per optimizer step of the tiny project);
- the tests of one file run on one worker, in file order (``--dist loadfile``), so module fixtures are
  built once and tests that share their state keep their order. (Not ``loadgroup``: with pytest 9.2 it
  silently stops grouping, pytest-xdist issue #1386.);
- the heaviest files start first (integration, then files with ``slow`` tests, then the rest), so no
  long file is left to run alone at the end.
"""
from __future__ import annotations

import fcntl
import gc
import os
import tempfile

import pytest

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set by pytest-xdist in each worker
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))

# One cache per test run, shared by xdist's workers (they inherit the controller's environment, set
# here before they start): the packaged chat model's GGUF is converted, and the CPU peak measured,
# once per run rather than once per worker. The process that made the folder removes it at the end.
_OWNER = not (os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("ONEGPU_TEST_CACHE"))
_CACHE = tempfile.mkdtemp(prefix="onegpu-test-cache-") if _OWNER else os.environ["ONEGPU_TEST_CACHE"]
os.environ["ONEGPU_TEST_CACHE"] = _CACHE
os.environ["XDG_CACHE_HOME"] = _CACHE
os.environ["ONEGPU_CACHE_DIR"] = os.path.join(_CACHE, "onegpu")  # onegpu.measure.flops reads it first

from onegpu import interpreter  # noqa: E402  (after the cache variables: onegpu modules may read them at import)
from onegpu.training.memory import host_allocator  # noqa: E402

# The test processes import torch, transformers and MLflow as the `onegpu` command does: the same
# garbage-collector start-up settings (onegpu.interpreter), and what collection leaves alive frozen.
gc.set_threshold(*interpreter.START_THRESHOLD)

# The test processes allocate host memory as a CPU training does by default (``train.cpu_allocator:
# caching``): freed blocks stay in the heap for the next step instead of going back to the kernel and
# being mapped and zero-filled afresh (measured: a float64 proof on the SmolLM2-shaped model spent 4.8 s
# of 10.7 in the kernel under glibc's defaults, 0.7 s of 7.3 so; tests/README.md). Process-wide and not
# inherited: the stages and ranks a test starts choose their own, as a user's do. A test that needs glibc's
# defaults runs them in a process of its own (test_same_training_classifier.py's ranks).
host_allocator.apply("caching", "cpu")


def pytest_collection_finish(session):
    gc.freeze()


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    for k in list(os.environ):
        if k.startswith(("MLFLOW_", "DVC_")):
            monkeypatch.delenv(k)


# -- shared fixtures: the packaged MiniLM tokenizer and a tiny 3-label dataset (32 rows of 4..34 tokens) --

LABELS = ["a", "b", "c"]


@pytest.fixture(scope="session")
def tokenizer():
    """The packaged all-MiniLM-L6-v2 tokenizer (no hub). Built once per session (per xdist worker): do
    not change it (add tokens, set a pad token) in a test; load your own for that."""
    from onegpu.models import loader
    loader.go_offline()
    return loader.load_tokenizer(loader.resolve_model_path("packaged:all-MiniLM-L6-v2"), "sequence-classification")


@pytest.fixture(scope="session")
def dsd(tokenizer):
    """32 texts of different lengths (micro-batches pad differently), labels a/b/c, tokenized to at most 32
    tokens with a ``length`` column; validation and test are 4-row slices. Built once per session (per
    xdist worker); ``Dataset`` methods return new datasets, so tests share it unchanged."""
    from datasets import ClassLabel, Dataset, DatasetDict
    texts = [" ".join(["token"] * (3 + (7 * i) % 29)) + f" {i}" for i in range(32)]
    ds = Dataset.from_dict({"text": texts, "label": [LABELS[i % 3] for i in range(32)]})
    ds = ds.cast_column("label", ClassLabel(names=LABELS))
    d = DatasetDict(train=ds, validation=ds.select(range(4)), test=ds.select(range(4)))

    def tok(b):
        enc = tokenizer(b["text"], truncation=True, max_length=32)
        enc["length"] = [len(x) for x in enc["input_ids"]]
        return enc
    return d.map(tok, batched=True)


# -- memory: the tests that hold several GB (float64 runs of the packaged 135M chat model) run one at a time --

MEMORY_LOCK = "big-memory.lock"  # in the run's shared cache folder


@pytest.fixture(autouse=True)
def _one_big_memory_test_at_a_time(request):
    """A ``big_memory`` test waits until no other worker runs one, and gives its freed heap back to the kernel
    after it (the caching host allocator would keep it in the worker). Two at once on different workers
    (8.4 and 8.1 GB peak RSS, each alone) got a worker OOM-killed on the 24 GiB CI machine."""
    if request.node.get_closest_marker("big_memory") is None:
        yield
        return
    with open(os.path.join(_CACHE, MEMORY_LOCK), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            gc.collect()
            host_allocator.release()
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(autouse=True, scope="module")
def _heap_back_after_each_file(request):
    """After a test file: its own caches (``functools.cache``'d runs and models at module level) cleared and the
    freed heap given back to the kernel. (Under the caching host allocator a worker kept what its heaviest file
    had freed: 4.4 GB after the packaged chat model's file, through every later file on that worker.)"""
    yield
    name = request.module.__name__
    for value in list(vars(request.module).values()):
        if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", None) == name:
            value.cache_clear()
    gc.collect()
    host_allocator.release()


def pytest_collection_modifyitems(config, items):
    _skip_gpu_tests(items)
    _heaviest_files_first(items)


def _skip_gpu_tests(items) -> None:
    """``gpu``-marked tests skip, with the reason, where torch sees no CUDA device."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def _heaviest_files_first(items) -> None:
    """Whole files, in this order: integration, other files with a ``slow`` test, the rest; the order of
    the files within each class and of the tests within each file is kept. (Starting the longest files
    first, by measured durations, was tried: 15 min 17 s and 16 min 5 s of tests against 14 min 4 s in
    this order, on the 2-core machine; the longest files at once contend for its cores and memory.)"""
    rank: dict = {}
    for item in items:
        heavy = 0 if "integration" in item.path.parts else 1 if item.get_closest_marker("slow") else 2
        rank[item.path] = min(rank.get(item.path, 2), heavy)
    items.sort(key=lambda item: rank[item.path])


def pytest_sessionfinish(session, exitstatus):
    if _OWNER:
        import shutil
        shutil.rmtree(_CACHE, ignore_errors=True)
