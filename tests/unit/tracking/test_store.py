"""The MLflow store: default location, experiment creation (also concurrent), runs, batched metrics.

mlflow is imported only inside the tests and fixtures that need it. Creating a fresh SQLite store costs
a few seconds (schema migrations), so the run-level tests share one store.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from onegpu import tracking
from onegpu.errors import UserError


@pytest.fixture(scope="module")
def store(store_root):
    """One tracker on one fresh default store, shared by the run-level tests of this module."""
    return tracking.connect("shared")


# -- connect -------------------------------------------------------------------------------------

def test_connect_creates_default_store_and_artifact_root(fresh_root, tmp_path):
    tr = tracking.connect("exp1")
    assert (fresh_root / "mlflow.db").is_file()
    assert tr.uri == f"sqlite:///{fresh_root}/mlflow.db"
    exp = tr.client.get_experiment(tr.experiment_id)
    assert exp.name == "exp1"
    assert exp.artifact_location == (fresh_root / "mlartifacts").as_uri()
    assert exp.artifact_location.startswith("file:///")
    assert os.listdir(tmp_path / "cwd") == []  # no mlruns/ or mlflow.db in the cwd

    again = tracking.connect("exp1")
    assert again.experiment_id == tr.experiment_id
    other = tracking.connect("exp2")
    assert other.experiment_id != tr.experiment_id


def test_concurrent_connects_to_fresh_store_agree(fresh_root):
    script = textwrap.dedent("""
        from onegpu import tracking
        tr = tracking.connect("race")
        print("EXP", tr.experiment_id)
    """)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["DVC_ROOT"] = str(fresh_root)
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, cwd=fresh_root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    ids = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        assert "Traceback" not in err, err
        line = [ln for ln in out.splitlines() if ln.startswith("EXP ")]
        assert len(line) == 1, out
        ids.append(line[0].split()[1])
    assert len(set(ids)) == 1, ids
    assert ids[0] != "0"  # never the Default experiment

    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{fresh_root}/mlflow.db")
    names = [e.name for e in client.search_experiments()]
    assert names.count("race") == 1


def test_connect_adopts_an_experiment_another_clone_created_meanwhile(fresh_root, monkeypatch):
    """Two clones of a project share one tracking server but not a file lock: the other clone can create
    the experiment between this process's look-up and its create. The create's "already exists" error
    then means: use that experiment (as the first look-up would have)."""
    from mlflow import MlflowClient
    theirs = MlflowClient(tracking_uri=f"sqlite:///{fresh_root}/mlflow.db").create_experiment("shared-exp")
    real = MlflowClient.get_experiment_by_name
    calls = []

    def not_yet(self, name):  # the first look-up runs before the other clone's create
        calls.append(name)
        return None if len(calls) == 1 else real(self, name)
    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", not_yet)
    tr = tracking.connect("shared-exp")
    assert tr.experiment_id == theirs
    assert len(calls) == 2


@pytest.mark.parametrize("uri", ["foo://bar", "sqlite://relative.db"])
def test_malformed_uri_raises_user_error(fresh_root, monkeypatch, uri):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(UserError, match="MLFLOW_TRACKING_URI"):
        tracking.connect("exp1")


def test_unsupported_scheme_message_redacts_password(fresh_root, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "foo://user:hunter2@host:1")
    with pytest.raises(UserError) as ei:
        tracking.connect("exp1")
    assert "hunter2" not in str(ei.value)
    assert "'foo'" in str(ei.value)


def test_redact_hides_password():
    red = tracking.redact("http://user:secret@host:5000")
    assert "secret" not in red
    assert red == "http://user:***@host:5000"
    assert tracking.redact("http://host:5000") == "http://host:5000"
    assert tracking.redact("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    # In any text quoting the URI (MLflow's errors name the request URL), percent-encoded or not.
    uri = "http://alice:p%40ss@host:5000"
    msg = "API request to http://alice:p%40ss@host:5000/api/2.0/x failed (http://alice:p@ss@host:5000)"
    assert tracking.redact(msg, uri) == ("API request to http://alice:***@host:5000/api/2.0/x failed "
                                         "(http://alice:***@host:5000)")
    assert tracking.redact("no credentials here", "http://host:5000") == "no credentials here"


@pytest.fixture
def failing_server(monkeypatch):
    """A tracking "server" on 127.0.0.1 that answers every request with HTTP 500; MLflow does not retry."""
    import http.server
    import threading

    class Fail(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(500)
            self.end_headers()
        do_POST = do_GET

        def log_message(self, *args):
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fail)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    yield srv.server_address[1]
    srv.shutdown()


def test_server_error_message_hides_the_password_of_the_uri(fresh_root, monkeypatch, failing_server):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:hunter2@127.0.0.1:{failing_server}")
    with pytest.raises(UserError) as ei:
        tracking.connect("exp1")
    message = str(ei.value)
    assert "cannot open the MLflow store http://alice:***@127.0.0.1" in message
    assert "API request to http://alice:***@127.0.0.1" in message  # MLflow's own text, redacted
    assert "hunter2" not in message


def test_password_in_the_uri_turns_off_mlflows_run_links(fresh_root, monkeypatch, failing_server):
    """MLflow prints "View run NAME at: <tracking URI>/#/..." when a run ends on a server."""
    from mlflow.environment_variables import MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{failing_server}")
    tracking.uri.store_uri(fresh_root)
    assert MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.get() is False  # no password: MLflow's links stay
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:hunter2@127.0.0.1:{failing_server}")
    tracking.uri.store_uri(fresh_root)
    assert MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.get() is True


# -- runs, metrics -------------------------------------------------------------------------------

def test_metric_buffer_logs_every_step_once(store):
    run_id = store.start_run("buffered", tags={"stage": "test"})
    buf = store.metric_buffer(run_id, flush_every=7, flush_seconds=3600)
    for step in range(1, 11):
        buf.add({"loss": 1.0 / step, "grad_norm": float(step), "learning_rate": 1e-4 * step}, step=step)
    assert buf.logged > 0  # 30 records with flush_every=7: some were flushed before the final flush
    buf.flush()
    assert buf.logged == 30
    buf.flush()  # idempotent
    assert buf.logged == 30
    for name in ("loss", "grad_norm", "learning_rate"):
        hist = store.client.get_metric_history(run_id, name)
        assert len(hist) == 10, name
        assert sorted(m.step for m in hist) == list(range(1, 11)), name
    gn = {m.step: m.value for m in store.client.get_metric_history(run_id, "grad_norm")}
    assert gn == {s: float(s) for s in range(1, 11)}
    store.end_run(run_id)


def test_metric_buffer_skips_none(store):
    run_id = store.start_run("none-values", tags={})
    buf = store.metric_buffer(run_id)
    buf.add({"a": 1.0, "b": None}, step=1)
    buf.flush()
    assert len(store.client.get_metric_history(run_id, "a")) == 1
    assert store.client.get_metric_history(run_id, "b") == []


def test_log_params_and_tags(store):
    run_id = store.start_run("params", tags={"stage": "test"})
    params = {f"p{i}": i for i in range(150)}  # more than one batch of 100
    params["none"] = None
    store.log_params(run_id, params)
    store.set_tags(run_id, {"equivalence_key": "0123456789abcdef"})
    store.log_metrics(run_id, {"x": 2, "y": None}, step=3)
    data = store.client.get_run(run_id).data
    assert data.params["p149"] == "149"
    assert data.params["none"] == "None"
    assert len([k for k in data.params if k.startswith("p")]) == 150
    assert data.tags["equivalence_key"] == "0123456789abcdef"
    assert data.tags["stage"] == "test"
    assert data.metrics == {"x": 2.0}


def test_guard_finished(store):
    run_id = store.start_run("ok", tags={})
    assert store.run_status(run_id) == "RUNNING"
    with store.guard(run_id):
        pass
    assert store.run_status(run_id) == "FINISHED"


def test_guard_finish_false_leaves_run_open(store):
    run_id = store.start_run("open", tags={})
    with store.guard(run_id, finish=False):
        pass
    assert store.run_status(run_id) == "RUNNING"


def test_guard_failed_on_error(store):
    run_id = store.start_run("fails", tags={})
    with pytest.raises(ValueError, match="boom"):
        with store.guard(run_id):
            raise ValueError("boom")
    run = store.client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["error.type"] == "ValueError"
    assert run.data.tags["error.message"] == "boom"


def test_guard_puts_its_note_of_the_error_over_the_description_the_run_had(store):
    run_id = store.start_run("evaluate-fails", tags={"mlflow.note.content": "<img src='figure'>"})
    with pytest.raises(ValueError):
        with store.guard(run_id, note=lambda e: f"**Failed**: `{e}`"):
            raise ValueError("boom")
    run = store.client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["mlflow.note.content"] == "**Failed**: `boom`\n\n<img src='figure'>"


def test_guard_error_message_tag_hides_the_password_of_the_uri(store, monkeypatch):
    monkeypatch.setattr(store.writer, "uri", "http://alice:hunter2@host:5000")
    run_id = store.start_run("fails-on-server", tags={})
    with pytest.raises(ValueError):
        with store.guard(run_id):
            raise ValueError("API request to http://alice:hunter2@host:5000/api/2.0/mlflow/runs/get failed")
    tags = store.client.get_run(run_id).data.tags
    assert tags["error.message"] == "API request to http://alice:***@host:5000/api/2.0/mlflow/runs/get failed"


def test_guard_killed_on_keyboard_interrupt(store):
    run_id = store.start_run("interrupted", tags={})
    with pytest.raises(KeyboardInterrupt):
        with store.guard(run_id):
            raise KeyboardInterrupt
    run = store.client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["error.type"] == "KeyboardInterrupt"


def test_runs_table_url(store):
    url = store.runs_table_url("http://127.0.0.1:5000/")
    assert url == f"http://127.0.0.1:5000/#/experiments/{store.experiment_id}/runs"


def test_run_context_tags_from_dvc_env(monkeypatch):
    monkeypatch.setenv("DVC_EXP_NAME", "funny-cat")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "a" * 40)
    tags = tracking.run_context_tags()
    assert tags["dvc.exp_name"] == "funny-cat"
    assert tags["dvc.baseline_rev"] == "a" * 40
    assert tags["mlflow.source.git.commit"] == "a" * 40
    assert tracking.run_name() == "funny-cat"
    monkeypatch.delenv("DVC_EXP_NAME")
    assert tracking.run_name() is None


def test_empty_tracking_uri_env_behaves_as_unset(fresh_root, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    tr = tracking.connect("exp-empty-env")
    assert tr.uri == f"sqlite:///{fresh_root}/mlflow.db"
    exp = tr.client.get_experiment(tr.experiment_id)
    assert exp.artifact_location == (fresh_root / "mlartifacts").as_uri()


# -- run lifecycle: no run RUNNING without a writer ---------------------------------------------------

def test_train_ends_its_run_and_evaluate_reopens_and_ends_it_again(store):
    run_id = store.start_run("lifecycle", tags={"stage": "train"})
    tags = store.client.get_run(run_id).data.tags
    assert tags[tracking.WRITER_PID] == str(os.getpid())
    with store.guard(run_id, finish="SCHEDULED"):  # train
        store.log_metrics(run_id, {"train_runtime": 1.0})
    assert store.run_status(run_id) == "SCHEDULED"  # trained, not evaluated: not RUNNING, not FINISHED
    store.resume_run(run_id)  # evaluate
    assert store.run_status(run_id) == "RUNNING"
    with store.guard(run_id):
        store.log_metrics(run_id, {"test_loss": 0.5})
    run = store.client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics == {"train_runtime": 1.0, "test_loss": 0.5}
    assert run.info.run_name == "lifecycle"


def test_resume_run_names_a_missing_or_deleted_run(store):
    with pytest.raises(UserError, match="is not in sqlite:///"):
        store.resume_run("0" * 32)
    run_id = store.start_run("to-delete", tags={})
    store.end_run(run_id)
    store.client.delete_run(run_id)
    with pytest.raises(UserError, match=f"is deleted .* mlflow runs restore --run-id {run_id}"):
        store.resume_run(run_id)


def test_runs_left_running_by_a_killed_process_are_marked_killed_when_a_stage_opens_a_run(store):
    import socket
    # A writer killed with SIGKILL: no guard, no handler runs; its run stays RUNNING.
    script = textwrap.dedent("""
        import os, signal
        from onegpu import tracking
        tr = tracking.connect("shared")
        print(tr.start_run("sigkilled", {"stage": "train"}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "MLFLOW_TRACKING_URI": store.uri}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == -9, p.stderr
    orphan = p.stdout.split()[0]
    assert store.run_status(orphan) == "RUNNING"

    host = socket.gethostname()
    alive = store.start_run("alive", tags={})  # this process writes to it
    other_host = store.client.create_run(store.experiment_id, tags={tracking.WRITER_HOST: "elsewhere",
                                                                    tracking.WRITER_PID: "1"}).info.run_id
    foreign = store.client.create_run(store.experiment_id, tags={}).info.run_id  # another tool's run
    reused = store.client.create_run(store.experiment_id, tags={  # our pid, but another process's start time
        tracking.WRITER_HOST: host, tracking.WRITER_PID: str(os.getpid()), tracking.WRITER_STARTED: "1.0"}).info.run_id

    new = store.start_run("next stage", tags={})  # opening a run reaps the orphans
    assert store.run_status(orphan) == "KILLED"
    assert store.run_status(reused) == "KILLED"
    reason = store.client.get_run(orphan).data.tags[tracking.KILLED_REASON]
    assert reason.startswith("left RUNNING: its writer, process ") and f"on {host}, is gone" in reason
    assert reason.endswith("killed outright: SIGKILL, e.g. the out-of-memory killer (see dmesg), a crash or a "
                           "power loss)")
    assert "another process" in store.client.get_run(reused).data.tags[tracking.KILLED_REASON]
    # its page says what happened and how to resume, first (the train stage adds the figure: test_closing_record)
    note = store.client.get_run(orphan).data.tags["mlflow.note.content"]
    assert note.startswith("**Killed outright** (KILLED): its writer, process ") and "To resume: train again" in note
    for run_id in (alive, other_host, foreign, new):
        assert store.run_status(run_id) == "RUNNING", run_id
    assert store.reap_orphans() == []
    for run_id in (alive, other_host, foreign, new):
        store.end_run(run_id)


def test_a_param_cut_at_mlflows_limit_gets_a_tag_saying_so(store):
    run_id = store.start_run("long-param", tags={})
    store.log_params(run_id, {"data.source": "x" * 7000, "short": "y"})
    data = store.client.get_run(run_id).data
    assert data.params["data.source"] == "x" * 6000
    assert data.tags[tracking.TRUNCATED_PARAMS] == "data.source (7000 characters, cut to 6000)"
    other = store.start_run("short-params", tags={})
    store.log_params(other, {"short": "y"})
    assert tracking.TRUNCATED_PARAMS not in store.client.get_run(other).data.tags
    store.end_run(run_id)
    store.end_run(other)


def test_deleted_experiment_says_how_to_restore_it(fresh_root):
    tr = tracking.connect("gone")
    tr.client.delete_experiment(tr.experiment_id)
    restore = f"mlflow experiments restore --experiment-id {tr.experiment_id}"
    with pytest.raises(UserError, match=f"'gone' \\(id {tr.experiment_id}\\) is deleted in sqlite:///") as ei:
        tracking.connect("gone")
    assert restore in str(ei.value) and "tracking.experiment_name" in str(ei.value)
    with pytest.raises(UserError, match=f"'gone' \\(id {tr.experiment_id}\\) is deleted in sqlite:///") as ei:
        tracking.open_existing("gone")
    assert restore in str(ei.value) and "--experiment" in str(ei.value)
