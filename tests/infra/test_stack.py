"""`flyroll stack up|status|down` end to end: real SeaweedFS and MLflow processes, detached."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from infra.services import pid_alive
from infra.stack import load_state, stack_env
from tests.support.services import mlflow_server, s3_server  # noqa: F401  (session fixtures)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def flyroll(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run the CLI in its own process, as a user would; `up` must leave services running after it exits."""
    return subprocess.run([sys.executable, "-c", "import sys; from infra.cli import main; sys.exit(main())",
                           "stack", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_stack_up_status_down(tmp_path):
    state_dir = str(tmp_path / "state")
    r = flyroll("up", "--state-dir", state_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    state = load_state(state_dir)
    try:
        env = stack_env(state)
        for var in ("MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                    "FLYROLL_S3_BUCKET"):
            assert f"export {var}={env[var]}" in r.stdout
        assert oct(os.stat(os.path.join(state_dir, "stack.json")).st_mode & 0o777) == "0o600"

        r = flyroll("status", "--state-dir", state_dir)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.count("running") == 2

        # both services answer: write through S3, log a run with an artifact through MLflow
        from infra.store import ArtifactStore

        store = ArtifactStore(f"s3://{state['s3']['bucket']}/store",
                              {"endpoint_url": env["AWS_ENDPOINT_URL"], "key": env["AWS_ACCESS_KEY_ID"],
                               "secret": env["AWS_SECRET_ACCESS_KEY"]})
        (tmp_path / "a.txt").write_text("hello")
        store.publish_file(str(tmp_path / "a.txt"), "smoke/v1", kind="dataset", producer="test")
        assert store.list("smoke") == ["smoke/v1"]
        script = ("import mlflow; mlflow.set_experiment('stack-smoke');\n"
                  "with mlflow.start_run() as r:\n"
                  "    mlflow.log_metric('m', 1.0); mlflow.log_text('hi', 'note.txt')\n"
                  "print(mlflow.artifacts.load_text(r.info.artifact_uri + '/note.txt'))")
        r = subprocess.run([sys.executable, "-c", script], env={**os.environ, **env},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "hi" in r.stdout, r.stdout + r.stderr
        assert [p for p in store.fs.find(f"{state['s3']['bucket']}/mlflow") if p.endswith("note.txt")]

        r = flyroll("up", "--state-dir", state_dir)  # idempotent
        assert r.returncode == 0 and "already running" in r.stdout
    finally:
        r = flyroll("down", "--state-dir", state_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not pid_alive(state["s3"]["pid"]) and not pid_alive(state["mlflow"]["pid"])
    assert load_state(state_dir) is None
    r = flyroll("status", "--state-dir", state_dir)
    assert r.returncode == 1 and "no stack" in r.stdout


@pytest.mark.slow
def test_mlflow_fixture_logs_artifacts_to_s3(mlflow_server, s3_server, tmp_path):
    """The fixtures other tests use: runs go to the server, artifacts land in the S3 bucket."""
    script = ("import mlflow; mlflow.set_experiment('fixture-smoke')\n"
              "with mlflow.start_run():\n"
              "    mlflow.log_metric('actor/loss', 0.5); mlflow.log_text('x', 'a.txt')\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **s3_server.env, "MLFLOW_TRACKING_URI": mlflow_server.tracking_uri})
    assert r.returncode == 0, r.stdout + r.stderr
    from infra.store import ArtifactStore

    fs = ArtifactStore(f"s3://{s3_server.bucket}", s3_server.storage_options).fs
    assert [p for p in fs.find(f"{s3_server.bucket}/mlflow") if p.endswith("/a.txt")]


def test_seaweed_and_mlflow_start_again_on_new_ports_when_one_they_were_given_is_taken(tmp_path, monkeypatch):
    """Free ports are picked, then bound by the server a moment later; another process can take one in
    between (CI saw SeaweedFS die with "bind: address already in use"). Here a listening socket holds
    the first port each server is handed: start-up must notice the bind failure in its log, pick new
    ports and come up; a start-up failure of any other kind is not retried."""
    import socket

    import infra.services as services
    from infra.services import MlflowServer, SeaweedS3, ServiceError

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    real_ports, calls = services.free_ports, []

    def first_call_hands_out_a_taken_port(n):
        calls.append(n)
        ports = real_ports(n)
        if len(calls) in (1, 3):  # the first pick of each server
            ports[-1 if n > 1 else 0] = taken
        return ports

    monkeypatch.setattr(services, "free_ports", first_call_hands_out_a_taken_port)
    monkeypatch.setattr(services, "free_port", lambda: first_call_hands_out_a_taken_port(1)[0])
    try:
        with SeaweedS3(bucket="flyroll", data_dir=str(tmp_path / "weed")) as s3:
            assert s3.port != taken and taken not in s3._ports.values()
            log = open(s3.log_path).read().lower()
            assert "address already in use" in log  # the first attempt really failed on the taken port
            with MlflowServer(work_dir=str(tmp_path / "mlflow")) as mlf:
                assert mlf.port != taken
                assert services.http_status(mlf.tracking_uri + "/health") == 200
                assert "address already in use" in open(mlf.log_path).read().lower()
        assert len(calls) == 4  # one retry each, no more
    finally:
        blocker.close()

    # not a port problem (a data dir that is a file): raised at once, no retry
    bad = tmp_path / "not-a-dir"
    bad.write_text("x")
    calls.clear()
    with pytest.raises((ServiceError, OSError)):
        SeaweedS3(bucket="flyroll", data_dir=str(bad)).start()
    assert len(calls) <= 1
