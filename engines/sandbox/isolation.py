"""The kernel layers of the code sandbox (engines/sandbox/runner.py): which this host gives, probed once per
process, and the host-side process control that goes with them.

- bubblewrap (`bwrap`): the host filesystem read-only, private /tmp and /dev/shm, the work dir the
  only writable host path, the host HOME hidden; new network, PID, IPC, UTS and cgroup namespaces.
- Without it, util-linux `unshare` (network, PID, mount + /proc), or nothing ("plain").
- As root, `setpriv` drops every run to a random unprivileged uid (`_random_uid`), and the host
  kills whatever that uid still runs afterwards (`_kill_uid`).

`isolation()` picks the strongest that passes a probe. Model code runs only under bubblewrap unless
the caller allows a weaker mode by name (`require_isolation(allow_weaker)`, config
`reward.sandbox.allow_weaker`): otherwise `SandboxUnavailable` says why and how to fix it.
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
import time

log = logging.getLogger("engines.sandbox.runner")

# allow_weaker name -> the modes without bubblewrap it admits (the bwrap modes are always admitted)
WEAKER_MODES = {"namespaces": ("root-ns", "userns"), "rlimits-only": ("root-ns", "userns", "plain")}
FIX = ("Fix: install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; it needs `setpriv` and `mount` "
       "from util-linux when run as root, or unprivileged user namespaces otherwise), or accept weaker "
       "isolation by name: reward.sandbox.allow_weaker: \"namespaces\" or \"rlimits-only\" (docs/sandbox.md)")


class SandboxUnavailable(RuntimeError):
    """The sandbox's kernel layers are missing and no weaker mode was allowed by name: model code is
    not run. The message says what is missing and how to fix it."""

# credential paths under HOME: hidden from the sandbox when HOME itself must stay visible, and
# refused to the program by the audit hook (engines/sandbox/runner.py passes them to it)
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

    @property
    def private_workdir(self) -> bool:
        """The work dir is a tmpfs inside the sandbox's mount namespace (no host directory behind it):
        bounded by max_disk_mb (and, where we mount it ourselves, by max_files), gone with the namespace."""
        return self.mode in ("bwrap-root", "bwrap-userns", "root-ns")

    @property
    def inode_limit(self) -> bool:
        """The work dir's tmpfs also has nr_inodes = max_files (mounted by `_MOUNT` with the caps of
        root in the new mount namespace, before the uid drop)."""
        return self.mode in ("bwrap-root", "root-ns")

    def command(self, workdir: str, uid: int | None = None, disk_mb: int = 256, max_files: int = 10_000) -> list[str]:
        """The prefix for one run, up to the interpreter: namespaces, the work dir (a `disk_mb` tmpfs
        with `max_files` inodes where `private_workdir`), then the drop to `uid` when given."""
        drop = _setpriv(uid) if uid is not None else []
        if self.mode == "bwrap-root":
            return [*self.prefix, *_bwrap_hide_home(), *_bwrap_show_interpreter(), "--perms", "0700", "--dir", workdir,
                    "--cap-add", "CAP_SYS_ADMIN", "--", *_mount_workdir(workdir, uid, disk_mb, max_files), *drop]
        if self.mode == "bwrap-userns":
            return [*self.prefix, *_bwrap_hide_home(), *_bwrap_show_interpreter(), "--perms", "0700",
                    "--size", str(disk_mb << 20), "--tmpfs", workdir, "--chdir", workdir, "--", *drop]
        if self.mode == "root-ns":     # mounted over the (empty) host dir, in the new mount namespace
            return [*self.prefix, *_mount_workdir(workdir, uid, disk_mb, max_files), *drop]
        return [*self.prefix, *drop]


def _mount_workdir(workdir: str, uid: int | None, disk_mb: int, max_files: int) -> list[str]:
    """sh -c: mount a tmpfs of `disk_mb` MiB and `max_files` (+3: the root, tmp/, program.py) inodes
    on `workdir`, owned by `uid`, then cd into it and exec the rest of the command line."""
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    opts = f"size={disk_mb}m,nr_inodes={max_files + 3},mode=0700,nosuid,nodev{owner}"
    return ["/bin/sh", "-c", f'mount -n -t tmpfs -o {opts} flyroll-work "$0" && cd "$0" && exec "$@"', workdir]


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
    paths = (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))
    # both as named and resolved: a virtual environment symlinked into the checkout (`.venv -> /elsewhere`) is
    # started through its link's path, which must exist inside the sandbox too (bwrap binds what it points to)
    for p in sorted({os.path.abspath(p) for p in paths} | {os.path.realpath(p) for p in paths}):
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
    """Drop to `uid` with no groups, no capabilities left in any set, and no_new_privs."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--bounding-set=-all",
            "--inh-caps=-all", "--no-new-privs", "--"]


@functools.lru_cache(maxsize=1)
def _probed() -> tuple[Isolation, str]:
    """(the strongest isolation that passes its probe, why bubblewrap is not it: "" when it is)."""
    bwrap, unshare, setpriv = shutil.which("bwrap"), shutil.which("unshare"), shutil.which("setpriv")
    root = os.geteuid() == 0
    missing = "bubblewrap (`bwrap`) is not on PATH"
    if bwrap and (setpriv or not root):
        iso = Isolation("bwrap-root" if root else "bwrap-userns", _bwrap_prefix(bwrap, root), root, True, True)
        probe_dir = "/tmp/flyroll-sbx-probe"
        uid = _random_uid() if root else None
        ok, why = _probe(iso.command(probe_dir, uid, 8, 16))
        if ok:
            return iso, ""
        missing = f"bubblewrap (`{bwrap}`) failed its probe ({why})"
    elif bwrap:
        missing = "`setpriv` (util-linux) is not on PATH, which bubblewrap needs as root"
    return _fallback(root, unshare, setpriv), missing


def isolation() -> Isolation:
    """The strongest isolation this host gives, probed once per process (it does not say whether
    model code may run under it: `require_isolation` does).

    bubblewrap (`bwrap`) on PATH: read-only host view + namespaces + the work dir on a private
    tmpfs, plus the uid drop when root ("bwrap-root", needs setpriv and mount) or a user namespace
    when not ("bwrap-userns"). Without it: root with unshare + setpriv: namespaces + unprivileged
    uid ("root-ns"); non-root with unprivileged user namespaces: namespaces, same uid ("userns");
    otherwise rlimits + audit hook only ("plain", plus the uid drop when root).
    """
    return _probed()[0]


_warned: set[str] = set()


def require_isolation(allow_weaker: str | None = None) -> Isolation:
    """The isolation model code runs under; fails closed. The bubblewrap modes always qualify; a mode
    without bubblewrap only when `allow_weaker` names a set that holds it ("namespaces": root-ns,
    userns; "rlimits-only": those and plain), and then with one warning per process. Otherwise
    raises `SandboxUnavailable` naming what is missing and the fix."""
    if allow_weaker is not None and allow_weaker not in WEAKER_MODES:
        raise ValueError(f"sandbox: allow_weaker={allow_weaker!r}, expected None or one of {sorted(WEAKER_MODES)}")
    iso, missing = _probed()
    if iso.fs_view:
        return iso
    if allow_weaker is None or iso.mode not in WEAKER_MODES[allow_weaker]:
        allowed = "" if allow_weaker is None else f" (allow_weaker={allow_weaker!r} admits only {WEAKER_MODES[allow_weaker]})"
        raise SandboxUnavailable(f"sandbox: {missing}; the strongest isolation left is mode {iso.mode!r}, and "
                                 f"model code runs without bubblewrap only when a weaker mode is allowed by "
                                 f"name{allowed}. Refusing to run model code. {FIX}")
    if iso.mode not in _warned:
        _warned.add(iso.mode)
        log.warning("sandbox: %s; running model code in the weaker mode %s%s, allowed by allow_weaker=%r: the host "
                    "filesystem is not read-only for native code (it can write wherever the sandbox uid may, e.g. "
                    "/tmp, /dev/shm)%s, and the work dir is on the host disk (bounded per file only; the verdict "
                    "says 'disk' past the budget). %s", missing, iso.mode,
                    "" if iso.mode != "plain" else (", uid drop" if iso.drop_uid else ", NO uid drop"), allow_weaker,
                    "" if iso.pidns else "; no namespaces either: network and process isolation rest on "
                    "the audit hook only", FIX)
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
