"""The kernel layers of the code sandbox (engines/sandbox.py): which this host gives, probed once per
process, and the host-side process control that goes with them.

- bubblewrap (`bwrap`): the host filesystem read-only, private /tmp and /dev/shm, the work dir the
  only writable host path, the host HOME hidden; new network, PID, IPC, UTS and cgroup namespaces.
- Without it, util-linux `unshare` (network, PID, mount + /proc), or nothing ("plain").
- As root, `setpriv` drops every run to a random unprivileged uid (`_random_uid`), and the host
  kills whatever that uid still runs afterwards (`_kill_uid`).

`isolation()` picks the strongest that passes a probe and logs one warning when it falls back;
docs/sandbox.md says what each layer stops.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

log = logging.getLogger("engines.sandbox")

# credential paths under HOME: hidden from the sandbox when HOME itself must stay visible, and
# refused to the program by the audit hook (engines/sandbox.py passes them to it)
_SECRET_HOME_PATHS = (".aws", ".ssh", ".kube", ".docker", ".netrc", ".git-credentials", ".pgpass",
                      ".config/gcloud", ".azure", ".flyte", ".config/flyte", ".mlflow", ".pypirc")


@dataclasses.dataclass(frozen=True)
class Isolation:
    """Which kernel layers this host gives the sandbox. See `isolation()`."""

    mode: str                  # "bwrap-root" | "bwrap-userns" | "root-ns" | "userns" | "plain"
    prefix: tuple[str, ...]    # command prefix (before the uid drop) that enters the namespaces
    drop_uid: bool             # setpriv to a random unprivileged uid (host runs as root)
    pidns: bool                # PID + network + mount namespace in effect
    fs_view: bool = False      # bwrap: read-only host, private /tmp, only the work dir writable

    def command(self, workdir: str) -> list[str]:
        """The prefix for one run; with bwrap it binds `workdir` (the only writable host path)."""
        if not self.fs_view:
            return list(self.prefix)
        return [*self.prefix, *_bwrap_hide_home(), *_bwrap_show_interpreter(), "--bind", workdir, workdir,
                "--chdir", workdir, "--"]


_NS_FLAGS = ("--net", "--pid", "--fork", "--kill-child", "--mount-proc")
_TMP_MB = 64                   # size of each private tmpfs (/tmp, /dev/shm); it is memory


def _bwrap_prefix(bwrap: str, root: bool) -> tuple[str, ...]:
    """bubblewrap: the whole host read-only, fresh /proc and /dev, private /tmp and /dev/shm
    (64 MiB tmpfs each, world-writable, gone after the run), and new IPC,
    PID, network, UTS and cgroup namespaces; SIGKILL when the host process dies. As root it
    creates the namespaces itself (setpriv then drops the uid); otherwise through a user
    namespace, inside which no further user namespace may be created."""
    user = () if root else ("--unshare-user", "--disable-userns")
    tmpfs = ("--perms", "1777", "--size", str(_TMP_MB << 20), "--tmpfs")
    return (bwrap, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", *tmpfs, "/dev/shm",
            *tmpfs, "/tmp", *user, "--unshare-ipc",
            "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session")


def _bwrap_hide_home() -> list[str]:
    """Hide the host HOME behind an empty tmpfs; when the interpreter lives under HOME (pyenv),
    hide only the credential paths that exist there."""
    home = os.path.realpath(os.path.expanduser("~"))
    if home == "/" or not os.path.isdir(home):
        return []
    interp = {os.path.realpath(p) for p in (sys.executable, sys.prefix, sys.base_prefix)}
    if not any(p == home or p.startswith(home + os.sep) for p in interp):
        return ["--tmpfs", home]
    out = []
    for rel in _SECRET_HOME_PATHS:
        p = os.path.join(home, rel)
        if os.path.isdir(p):
            out += ["--tmpfs", p]
        elif os.path.exists(p):
            out += ["--ro-bind", "/dev/null", p]
    return out


def _bwrap_show_interpreter() -> list[str]:
    """Bind the interpreter's install read-only back over the private /tmp and /dev/shm when it lives
    there (a virtual environment in a checkout under /tmp); otherwise the sandbox could not start it."""
    out: list[str] = []
    for p in sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))}):
        if any(p == d or p.startswith(d + os.sep) for d in ("/tmp", "/dev/shm")) and p not in ("/tmp", "/dev/shm"):
            if not any(p.startswith(q + os.sep) for q in out[1::3]):
                out += ["--ro-bind", p, p]
    return out


def _probe(cmd: list[str]) -> tuple[bool, str]:
    check = "import fractions, json, pickle, resource, socket, threading, traceback; print('ok')"
    try:
        r = subprocess.run(cmd + [sys.executable, "-I", "-B", "-c", check], capture_output=True,
                           timeout=20, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    ok = r.returncode == 0 and r.stdout.strip() == b"ok"
    return ok, "" if ok else (r.stderr.decode(errors="replace").strip()[-300:] or f"exit {r.returncode}")


def _setpriv(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"]


@functools.lru_cache(maxsize=1)
def isolation() -> Isolation:
    """Probe, once, the strongest isolation this host allows; logs one warning when it falls back.

    bubblewrap (`bwrap`) on PATH: read-only host view + namespaces, plus the uid drop when root
    ("bwrap-root", needs setpriv) or a user namespace when not ("bwrap-userns"). Without it:
    root with unshare + setpriv: namespaces + unprivileged uid ("root-ns"); non-root with
    unprivileged user namespaces: namespaces, same uid ("userns"); otherwise rlimits + audit hook
    only ("plain", plus the uid drop when root).
    """
    bwrap, unshare, setpriv = shutil.which("bwrap"), shutil.which("unshare"), shutil.which("setpriv")
    root = os.geteuid() == 0
    missing = "bubblewrap (`bwrap`) is not on PATH"
    if bwrap and (setpriv or not root):
        iso = Isolation("bwrap-root" if root else "bwrap-userns", _bwrap_prefix(bwrap, root), root, True, True)
        probe_dir = tempfile.mkdtemp(prefix="flyroll-sbx-probe-")
        try:
            ok, why = _probe(iso.command(probe_dir) + (_setpriv(_random_uid()) if root else []))
        finally:
            shutil.rmtree(probe_dir, ignore_errors=True)
        if ok:
            return iso
        missing = f"bubblewrap (`{bwrap}`) failed its probe ({why})"
    elif bwrap:
        missing = "`setpriv` (util-linux) is not on PATH, which bubblewrap needs as root"
    iso = _fallback(root, unshare, setpriv)
    log.warning("sandbox: %s; falling back to mode %s%s: without bubblewrap the host filesystem is "
                "not read-only for native code (it can write wherever the sandbox uid may, e.g. /tmp, "
                "/dev/shm)%s. Install the Debian package `bubblewrap`.", missing, iso.mode,
                "" if iso.mode != "plain" else (", uid drop" if iso.drop_uid else ", NO uid drop"),
                "" if iso.pidns else "; no namespaces either: network and process isolation rest on "
                "the audit hook only")
    return iso


def _fallback(root: bool, unshare: str | None, setpriv: str | None) -> Isolation:
    """The modes without bubblewrap: util-linux `unshare` (+ `setpriv` as root), else plain."""
    if root and unshare and setpriv:
        prefix = ("unshare", *_NS_FLAGS, "--")
        if _probe(list(prefix) + _setpriv(_random_uid()))[0]:
            return Isolation("root-ns", prefix, True, True)
    if not root and unshare:
        for userflag in ("--map-current-user", "--map-root-user"):
            prefix = ("unshare", "--user", userflag, *_NS_FLAGS, "--")
            if _probe(list(prefix))[0]:
                return Isolation("userns", prefix, False, True)
    drop = root and bool(setpriv) and _probe(_setpriv(_random_uid()))[0]
    return Isolation("plain", (), drop, False)


def _random_uid() -> int:
    return 1 << 30 | secrets.randbelow(1 << 29)   # far from real accounts; unique per run in practice


def _tasks_of_uid(uid: int) -> int:
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{d}/task"))
            except OSError:
                pass
    return n


def _kill_uid(uid: int) -> None:
    """SIGKILL every live process owned by `uid` until none is left (host-side /proc scan)."""
    for _ in range(100):
        found = False
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/status") as f:
                    st = f.read()
                uids = next(line for line in st.splitlines() if line.startswith("Uid:")).split()[1:]
                state = next(line for line in st.splitlines() if line.startswith("State:")).split()[1]
            except (OSError, StopIteration, IndexError):
                continue
            if str(uid) in uids and state != "Z":
                found = True
                try:
                    os.kill(int(d), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if not found:
            return
        time.sleep(0.01)
