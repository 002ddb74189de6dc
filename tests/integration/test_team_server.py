"""A team's tracking server: PostgreSQL (a cluster of its own, from the machine's PostgreSQL binaries)
behind `mlflow server` with MLflow's basic authentication and served artifacts, on 127.0.0.1. Two clones
of one project each queue an experiment (one split of the effective batch each) and run it, both at once,
into that server: every run arrives complete and named after its experiment, artifacts go through the server,
`onegpu compare` groups the runs of both clones, and the passwords (alice's in MLFLOW_TRACKING_URI for
one clone, bob's in MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD for the other) show up nowhere.

Skipped where PostgreSQL's server binaries are missing (``apt-get install postgresql``), failed under CI
(`.ci/run` installs them and sets CI=true: tests/needs.py).
"""
from __future__ import annotations

import base64
import glob
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from onegpu import ui
from tests import needs

from .conftest import BIN, _env, dvc, make_project, run, wait_for_queue

pytestmark = pytest.mark.slow

MAX_STEPS = 3  # TINY
# The server's admin, and a member the admin adds (MLflow wants passwords of 12 characters or more).
USER, SECRET = "alice", "s3cret-Pa55-team"
MEMBER, MEMBER_SECRET = "bob", "b0b-s3cret-Pa55"
# Two splits of effective batch 8 (TINY's dropout is 0), one per clone: one equivalence key for both runs.
SPLITS = {"8x1": ("8", "1"), "2x4": ("2", "4")}
CLONE_SPLIT = {"a": "8x1", "b": "2x4"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin() -> Path | None:
    """The directory of PostgreSQL's initdb: on PATH, else Debian's /usr/lib/postgresql/<version>/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                  key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return Path(dirs[-1]).parent if dirs else None


@pytest.fixture
def postgres():
    """A PostgreSQL cluster of this test on 127.0.0.1 (trust authentication, loopback only) with a
    database `mlflow`; yields its SQLAlchemy URI. PostgreSQL refuses to run as root: as root, the
    cluster belongs to the `postgres` user (or `nobody`). Databases: `mlflow` (runs), `mlflow_auth` (users)."""
    bindir = _pg_bin()
    if bindir is None:
        needs.missing("PostgreSQL's server binaries (initdb, pg_ctl) not found: apt-get install postgresql")
    as_user: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="onegpu-pg-", dir="/tmp" if os.geteuid() == 0 else None))
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            user = pwd.getpwnam("nobody")
        os.chmod(base, 0o755)
        os.chown(base, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", user.pw_name, "--"]
    data, port = base / "data", _free_port()
    env = {k: v for k, v in _env().items() if not k.startswith("PG")}

    def pg(*cmd: str) -> None:
        p = subprocess.run([*as_user, *cmd], env=env, cwd=base, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"

    started = False
    try:
        pg(str(bindir / "initdb"), "-D", str(data), "-U", "onegpu", "--auth=trust", "-E", "UTF8", "--no-sync")
        pg(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(base / "postgres.log"), "-w", "-t", "60",
           "-o", f"-c listen_addresses=127.0.0.1 -p {port} -k {base}", "start")
        started = True
        for db in ("mlflow", "mlflow_auth"):
            pg(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "onegpu", db)
        yield f"postgresql+psycopg://onegpu@127.0.0.1:{port}/"
    finally:
        if started:
            pg(str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def server(postgres, tmp_path):
    """`mlflow server --app-name basic-auth` on the cluster (admin USER, password SECRET), serving
    artifacts from its own folder; yields (URL, that folder)."""
    port, artifacts = _free_port(), tmp_path / "server-artifacts"
    auth = tmp_path / "basic_auth.ini"
    # EDIT: every member logs into the experiment the first one created (READ would refuse bob's runs).
    auth.write_text(f"[mlflow]\ndefault_permission = EDIT\ndatabase_uri = {postgres}mlflow_auth\n"
                    f"admin_username = {USER}\nadmin_password = {SECRET}\n"
                    "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                    # Measured: without the cache (a PBKDF2 password check per request) this test took
                    # 4 min 40 s, the server and the test's own processes 116 s of CPU; with it 2 min 11 s, 42 s.
                    "auth_cache_ttl_seconds = 60\n")
    env = ui.server_env({**_env(), "MLFLOW_AUTH_CONFIG_PATH": str(auth),  # GenAI job runner off, as onegpu ui
                         "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-only"})
    log = (tmp_path / "mlflow-server.log").open("w")
    p = subprocess.Popen([str(BIN / "mlflow"), "server", "--app-name", "basic-auth",
                          "--backend-store-uri", f"{postgres}mlflow",
                          "--artifacts-destination", str(artifacts), "--serve-artifacts",
                          "--host", "127.0.0.1", "--port", str(port), "--workers", "2"],
                         env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError as e:
                if p.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("mlflow server did not start:\n"
                                         + (tmp_path / "mlflow-server.log").read_text()[-4000:]) from e
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", artifacts
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=60)
        log.close()


def test_two_clones_queueing_at_once_log_complete_runs_into_one_server(server, tmp_path):
    url, served = server
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError, match="401"):  # the server wants credentials
        urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10)
    uri = url.replace("http://", f"http://{USER}:{SECRET}@")
    # The admin adds a member (MLflow's REST API; mlflow.server.auth.client.AuthServiceClient does the same).
    token = base64.b64encode(f"{USER}:{SECRET}".encode()).decode()
    request = urllib.request.Request(f"{url}/api/2.0/mlflow/users/create", method="POST",
                                     data=json.dumps({"username": MEMBER, "password": MEMBER_SECRET}).encode(),
                                     headers={"Authorization": f"Basic {token}",
                                              "Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=30)
    # Clone a: alice, credentials in the URI; clone b: bob, in MLflow's variables. Neither is ever shown.
    envs = {"a": {**_env(), "MLFLOW_TRACKING_URI": uri, "PYTHONUNBUFFERED": "1"},
            "b": {**_env(), "MLFLOW_TRACKING_URI": url, "MLFLOW_TRACKING_USERNAME": MEMBER,
                  "MLFLOW_TRACKING_PASSWORD": MEMBER_SECRET, "PYTHONUNBUFFERED": "1"}}
    # One member prepares the data once; the clones share that DVC cache (as a team shares a DVC
    # remote), so their experiments train and evaluate without preparing again.
    base = make_project(tmp_path / "base")
    p = subprocess.run([str(BIN / "dvc"), "repro", "prepare"], cwd=base, env=envs["a"], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    logs = [p.stdout + p.stderr]
    run(["git", "add", "dvc.lock", "data"], base)
    run(["git", "commit", "-qm", "prepared"], base)
    clones = {c: tmp_path / c for c in ("a", "b")}
    for c, path in clones.items():
        run(["git", "clone", "-q", str(base), str(path)], tmp_path)
        dvc(path, "cache", "dir", "--local", str(base / ".dvc" / "cache"))
        dvc(path, "checkout", "prepare")
        name = CLONE_SPLIT[c]
        micro, accum = SPLITS[name]
        dvc(path, "exp", "run", "--queue", "-n", f"{c}-{name}",
            "-S", f"train.per_device_train_batch_size={micro}", "-S", f"train.gradient_accumulation_steps={accum}")
    # The workers take their environment from `dvc queue start`: both clones start theirs at once.
    # (Output to a file: the detached workers inherit it, so a pipe would stay open until they end.)
    starts = []
    for c, path in clones.items():
        with (path.parent / f"queue-start-{c}.log").open("w") as out:
            starts.append(subprocess.Popen([str(BIN / "dvc"), "queue", "start"], cwd=path,
                                           env=envs[c], stdout=out, stderr=subprocess.STDOUT))
    for p, c in zip(starts, clones):
        assert p.wait(timeout=120) == 0, (tmp_path / f"queue-start-{c}.log").read_text()
    for c, path in clones.items():
        status = wait_for_queue(path)
        assert status.count("Success") == 1, status
        logs.append(dvc(path, "queue", "logs", f"{c}-{CLONE_SPLIT[c]}").stdout)
    print(f"queued experiments done after {time.monotonic() - t0:.0f} s")
    assert all("Running stage 'prepare'" not in log for log in logs[1:]), logs  # the shared cache had it
    names = sorted(f"{c}-{n}" for c, n in CLONE_SPLIT.items())
    assert all("Traceback" not in log for log in logs), logs

    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts
    client = MlflowClient(tracking_uri=uri)
    assert [e.name for e in client.search_experiments()].count("onegpu") == 1
    exp = client.get_experiment_by_name("onegpu")
    assert client.search_runs(["0"], max_results=10) == []  # nothing in the Default experiment
    everything = client.search_runs([exp.experiment_id], max_results=1000)
    train = [r for r in everything if r.data.tags.get("stage") == "train"]
    assert sorted(r.info.run_name for r in train) == names
    for r in train:
        rid = r.info.run_id
        assert r.info.status == "FINISHED"
        assert r.info.run_name == r.data.tags["dvc.exp_name"]
        micro, accum = SPLITS[r.info.run_name.split("-", 1)[1]]
        assert (r.data.params["resolved.per_device_train_batch_size"],
                r.data.params["resolved.gradient_accumulation_steps"]) == (micro, accum)
        for key in ("loss", "grad_norm", "samples_per_second", "mem_peak_bytes"):
            steps = sorted(m.step for m in client.get_metric_history(rid, key))
            assert steps == list(range(1, MAX_STEPS + 1)), (r.info.run_name, key, steps)
        m = r.data.metrics
        assert m["train_runtime"] > 0 and "mem_params_bytes" in m
        assert 0.0 <= m["test_accuracy"] <= 1.0 and m["test_loss"] > 0
        # Artifacts go through the server (clients need no access to its storage).
        assert r.info.artifact_uri.startswith("mlflow-artifacts:/"), r.info.artifact_uri
        png = Path(download_artifacts(artifact_uri=f"{r.info.artifact_uri}/confusion_matrix.png",
                                      dst_path=str(tmp_path / "dl" / rid), tracking_uri=uri))
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list(served.rglob("confusion_matrix.png"))) == 2
    for path in clones.values():
        assert not (path / "mlartifacts").exists() and not (path / "mlflow.db").exists()
    assert len({r.data.tags["equivalence_key"] for r in train}) == 1

    # From either clone: one group holding the runs of both; with dropout 0 the splits agree step by step.
    outputs = []
    for c, path in clones.items():
        p = subprocess.run([str(BIN / "onegpu"), "compare"], cwd=path, env=envs[c], capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "group 1 key" in p.stdout and "group 2" not in p.stdout, p.stdout
        assert "(2 runs, 1 equivalent, 0 diverged)" in p.stdout, p.stdout
        assert all(n in p.stdout for n in names), p.stdout
        outputs += [p.stdout, p.stderr, (path / "reports" / "compare.md").read_text()]
    assert f"(store `http://{USER}:***@127.0.0.1:" in outputs[2]
    assert f"(store `{url}`)" in outputs[5]

    # The passwords are nowhere: not in any run's params or tags, the terminal output or the report.
    everything = client.search_runs([exp.experiment_id], max_results=1000)
    assert {r.data.tags.get("stage") for r in everything} >= {"prepare", "train", "compare"}
    logged = [v for r in everything for v in (*r.data.params.values(), *r.data.tags.values())]
    leaks = [v for v in logged if SECRET in v or MEMBER_SECRET in v]
    assert leaks == []
    for text in (*logs, *outputs):
        assert SECRET not in text and MEMBER_SECRET not in text
