"""`flyroll stack up|down|status`: the local service stack, detached on loopback.

    flyroll stack up       start SeaweedFS (S3) + an MLflow server (SQLite store, artifacts on
                           that S3) in the background; print the env vars to export
    flyroll stack status   what runs, and whether it answers; exit 1 when something is down
    flyroll stack down     stop both (SIGTERM, then SIGKILL after a grace period)

State (pids, ports, URIs, the generated S3 credentials; mode 0600) lives in
<state-dir>/stack.json, default ~/.flyroll; data stays in <state-dir>/seaweed and
<state-dir>/mlflow across up/down (`down --purge` deletes it). See docs/storage.md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
from typing import Any

from infra.services import (
    MlflowServer,
    SeaweedS3,
    ServiceError,
    cleanup_seaweed_sockets,
    http_status,
    pid_alive,
    pid_cmdline,
    stop_pid,
)

STATE_FILE = "stack.json"


def default_state_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".flyroll")


def load_state(state_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(state_dir, STATE_FILE)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _save_state(state_dir: str, state: dict[str, Any]) -> None:
    path = os.path.join(state_dir, STATE_FILE)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the S3 secret
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=2)
    os.replace(tmp, path)


def stack_env(state: dict[str, Any]) -> dict[str, str]:
    """The env vars that point flyroll, boto3/s3fs and MLflow clients at the stack."""
    s3 = state["s3"]
    return {
        "MLFLOW_TRACKING_URI": state["mlflow"]["tracking_uri"],
        "AWS_ENDPOINT_URL": s3["endpoint_url"],
        "MLFLOW_S3_ENDPOINT_URL": s3["endpoint_url"],
        "AWS_ACCESS_KEY_ID": s3["access_key"],
        "AWS_SECRET_ACCESS_KEY": s3["secret_key"],
        "AWS_DEFAULT_REGION": "us-east-1",
        "FLYROLL_S3_BUCKET": s3["bucket"],
        "FLYROLL_STORE_URI": f"s3://{s3['bucket']}/store",
    }


def service_health(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per service: pid alive, and whether its port answers."""
    s3, mlf = state["s3"], state["mlflow"]
    return {
        "s3": {"pid": s3["pid"], "alive": _ours(s3["pid"], "weed"), "url": s3["endpoint_url"],
               "answers": http_status(s3["endpoint_url"] + "/") is not None},
        "mlflow": {"pid": mlf["pid"], "alive": _ours(mlf["pid"], "mlflow"), "url": mlf["tracking_uri"],
                   "answers": http_status(mlf["tracking_uri"] + "/health") == 200},
    }


def _ours(pid: int, word: str) -> bool:
    """Alive and still the program we started (a recycled pid is someone else's process)."""
    return pid_alive(pid) and word in pid_cmdline(pid)


def up(state_dir: str, bucket: str) -> int:
    state = load_state(state_dir)
    if state is not None:
        health = service_health(state)
        if all(h["alive"] for h in health.values()):
            print(f"stack already running (state {os.path.join(state_dir, STATE_FILE)})")
            _print_env(state)
            return 0
        print("a previous stack is partly down; stopping what is left and starting afresh")
        down(state_dir, quiet=True)
    os.makedirs(state_dir, exist_ok=True)
    creds_path = os.path.join(state_dir, "seaweed", "s3-identities.json")
    access_key, secret_key = _existing_credentials(creds_path)  # keep old data readable
    s3 = SeaweedS3(bucket=bucket, data_dir=os.path.join(state_dir, "seaweed"), detach=True,
                   access_key=access_key or "flyroll-" + secrets.token_hex(4),
                   secret_key=secret_key or secrets.token_hex(16))
    try:
        s3.start()
        mlf = MlflowServer(s3=s3, work_dir=os.path.join(state_dir, "mlflow"), detach=True).start()
    except ServiceError as e:
        s3.stop()
        print(f"flyroll stack up: {e}", file=sys.stderr)
        return 1
    state = {
        "s3": {"pid": s3.pid, "endpoint_url": s3.endpoint_url, "bucket": bucket, "access_key": s3.access_key,
               "secret_key": s3.secret_key, "ports": s3._ports, "data_dir": s3.data_dir, "log": s3.log_path,
               "start_s": round(s3.ready_s, 2)},
        "mlflow": {"pid": mlf.pid, "tracking_uri": mlf.tracking_uri, "artifacts": mlf.artifacts_destination,
                   "backend_store": f"sqlite:///{os.path.join(mlf.work_dir, 'mlflow.db')}", "log": mlf.log_path,
                   "start_s": round(mlf.start_s, 2)},
    }
    _save_state(state_dir, state)
    print(f"SeaweedFS S3 at {s3.endpoint_url} (bucket {bucket!r}, ready in {s3.ready_s:.1f}s, pid {s3.pid})")
    print(f"MLflow server at {mlf.tracking_uri} (ready in {mlf.start_s:.1f}s, pid {mlf.pid})")
    _print_env(state)
    return 0


def _existing_credentials(path: str) -> tuple[str | None, str | None]:
    try:
        with open(path) as f:
            cred = json.load(f)["identities"][0]["credentials"][0]
        return cred["accessKey"], cred["secretKey"]
    except (OSError, ValueError, KeyError, IndexError):
        return None, None


def _print_env(state: dict[str, Any]) -> None:
    print("\n# export these to use the stack (or: eval \"$(flyroll stack status --env)\")")
    for k, v in stack_env(state).items():
        print(f"export {k}={v}")
    print(f"\n# MLflow UI: {state['mlflow']['tracking_uri']}")


def status(state_dir: str, env_only: bool = False) -> int:
    state = load_state(state_dir)
    if state is None:
        print(f"no stack (no {os.path.join(state_dir, STATE_FILE)}); start one with `flyroll stack up`",
              file=sys.stderr if env_only else sys.stdout)
        return 1
    if env_only:
        for k, v in stack_env(state).items():
            print(f"export {k}={v}")
        return 0
    health = service_health(state)
    for name, h in health.items():
        word = "running" if h["alive"] and h["answers"] else ("not answering" if h["alive"] else "stopped")
        print(f"{name:7s} {word:14s} pid {h['pid']:<8d} {h['url']}")
    print(f"bucket  {state['s3']['bucket']}   artifacts {state['mlflow']['artifacts']}   "
          f"state {os.path.join(state_dir, STATE_FILE)}")
    return 0 if all(h["alive"] and h["answers"] for h in health.values()) else 1


def down(state_dir: str, purge: bool = False, quiet: bool = False) -> int:
    state = load_state(state_dir)
    if state is None:
        if not quiet:
            print("no stack to stop")
    else:
        for name, word, grace_s in (("mlflow", "mlflow", 5.0), ("s3", "weed", 2.0)):
            if _ours(state[name]["pid"], word):
                stop_pid(state[name]["pid"], grace_s=grace_s)
        cleanup_seaweed_sockets(state["s3"].get("ports", {}).values())
        os.remove(os.path.join(state_dir, STATE_FILE))
        if not quiet:
            print(f"stopped MLflow (pid {state['mlflow']['pid']}) and SeaweedFS (pid {state['s3']['pid']})")
    if purge:
        for sub in ("seaweed", "mlflow"):
            shutil.rmtree(os.path.join(state_dir, sub), ignore_errors=True)
        if not quiet:
            print(f"deleted the stack's data under {state_dir}")
    return 0


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="flyroll stack", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--state-dir", default=default_state_dir(),
                        help="where the state file and the services' data live (default ~/.flyroll)")
    parser.add_argument("--bucket", default="flyroll", help="S3 bucket to create (up only)")
    parser.add_argument("--env", action="store_true", help="status: print only the export lines")
    parser.add_argument("--purge", action="store_true", help="down: also delete the S3 data and the MLflow db")
    args = parser.parse_args(argv)
    state_dir = os.path.abspath(os.path.expanduser(args.state_dir))
    if args.action == "up":
        return up(state_dir, args.bucket)
    if args.action == "status":
        return status(state_dir, env_only=args.env)
    return down(state_dir, purge=args.purge)


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
