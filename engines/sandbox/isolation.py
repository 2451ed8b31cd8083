"""The kernel layers of the code sandbox (engines/sandbox/runner.py): which this host gives, probed once per
process, and the host-side process control that goes with them.

- bubblewrap (`bwrap`): the host filesystem read-only, private /tmp and /dev/shm, the work dir the
  only writable host path, the host HOME hidden; new network, PID, IPC, UTS and cgroup namespaces;
  where bwrap has `--disable-userns` (0.8+) the program runs in a user namespace that can create no
  further one, so no nested user (and with it mount) namespace either (`_bwrap_disables_userns`).
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

# credential paths under HOME: refused to the program by the audit hook (engines/sandbox/runner.py passes
# them to it); under bubblewrap the whole HOME is hidden besides (`_bwrap_hide_home`)
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
    userns_disabled: bool = False   # bwrap --disable-userns: the program runs in a user namespace that can create none
    nested_userns: bool | None = None   # the probe's program could create a user namespace (None: not probed)

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
            # with --disable-userns: a second bwrap, as the dropped uid, puts the program in a user namespace that
            # can create none (bwrap's own user namespace maps one uid only, so the first, root one, cannot drop to
            # a random uid inside it); it sees the same (read-only) tree, binds its own
            inner = [self.prefix[0], "--dev-bind", "/", "/", "--unshare-user", "--disable-userns", "--die-with-parent",
                     "--chdir", workdir, "--"] if self.userns_disabled else []
            return [*self.prefix, *_bwrap_hide_home(), "--perms", "0700", "--dir", workdir,
                    "--cap-add", "CAP_SYS_ADMIN", "--", *_mount_workdir(workdir, uid, disk_mb, max_files), *drop, *inner]
        if self.mode == "bwrap-userns":
            user = ("--unshare-user", "--disable-userns") if self.userns_disabled else ("--unshare-user",)
            return [*self.prefix, *user, *_bwrap_hide_home(), "--perms", "0700",
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


def _bwrap_prefix(bwrap: str) -> tuple[str, ...]:
    """bubblewrap: the whole host read-only, fresh /proc and /dev, private /tmp and /dev/shm
    (64 MiB tmpfs each, world-writable, gone after the run), and new IPC,
    PID, network, UTS and cgroup namespaces; SIGKILL when the host process dies. As root it
    creates the namespaces itself (setpriv then drops the uid); otherwise through a user
    namespace (`Isolation.command` adds it, and where bwrap can, forbids further ones)."""
    tmpfs = ("--perms", "1777", "--size", str(_TMP_MB << 20), "--tmpfs")
    return (bwrap, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", *tmpfs, "/dev/shm",
            *tmpfs, "/tmp", "--unshare-ipc",
            "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session")


def _bwrap_hide_home() -> list[str]:
    """Hide the host HOME behind an empty tmpfs, then bind the interpreter's install read-only back
    over it and over the private /tmp and /dev/shm where it lives there (pyenv in HOME, a virtual
    environment in a checkout under /tmp); otherwise the sandbox could not start it. Those binds sit
    on a world-readable tmpfs, so the dropped uid reaches them even where HOME itself is 0700 (a
    sandbox user namespace sees root's files as other's)."""
    home = os.path.realpath(os.path.expanduser("~"))
    hidden = ["/tmp", "/dev/shm"]
    out: list[str] = []
    if home != "/" and os.path.isdir(home):
        out += ["--tmpfs", home]
        hidden.append(home)
    paths = (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))
    # both as named and resolved: a virtual environment symlinked into the checkout (`.venv -> /elsewhere`) is
    # started through its link's path, which must exist inside the sandbox too (bwrap binds what it points to)
    binds: list[str] = []
    for p in sorted({os.path.abspath(p) for p in paths} | {os.path.realpath(p) for p in paths}):
        if any(p.startswith(d + os.sep) for d in hidden) and not any(p == q or p.startswith(q + os.sep) for q in binds):
            binds.append(p)
    made: set[str] = set()
    for p in binds:       # the folders on the way, world-traversable (bwrap would make them 0700, root's)
        top = next(d for d in hidden if p.startswith(d + os.sep))
        parts = p[len(top) + 1:].split(os.sep)[:-1]
        for i in range(1, len(parts) + 1):
            d = os.path.join(top, *parts[:i])
            if d not in made:
                made.add(d)
                out += ["--perms", "0755", "--dir", d]
        out += ["--ro-bind", p, p]
    return out


def _bwrap_disables_userns(bwrap: str) -> bool:
    """Whether this bubblewrap has `--disable-userns` (0.8+), read from its `--help`."""
    try:
        r = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return b"--disable-userns" in r.stdout + r.stderr


# the probe's program: the modules a run needs, then whether it can create a user namespace (CLONE_NEWUSER)
_PROBE = ("import fractions, json, pickle, resource, socket, threading, traceback\n"
          "try:\n    import ctypes\n    r = ctypes.CDLL(None, use_errno=True).unshare(0x10000000)\n"
          "except Exception:\n    r = None\n"
          "print('ok', 'unknown' if r is None else 'nested-userns' if r == 0 else 'no-userns')")


def _probe(cmd: list[str]) -> tuple[bool, str, bool | None]:
    """(the command runs the interpreter, why not, whether the program there could create a user namespace)."""
    try:
        r = subprocess.run(cmd + [sys.executable, "-I", "-B", "-c", _PROBE], capture_output=True,
                           timeout=20, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e), None
    out = r.stdout.split()
    ok = r.returncode == 0 and out[:1] == [b"ok"]
    nested = {b"nested-userns": True, b"no-userns": False}.get(out[1]) if ok and len(out) > 1 else None
    return ok, "" if ok else (r.stderr.decode(errors="replace").strip()[-300:] or f"exit {r.returncode}"), nested


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
        mode, uid = ("bwrap-root", _random_uid()) if root else ("bwrap-userns", None)
        disables = _bwrap_disables_userns(bwrap)
        refused = ""
        for off in (True, False) if disables else (False,):
            iso = Isolation(mode, _bwrap_prefix(bwrap), root, True, True, userns_disabled=off)
            ok, why, nested = _probe(iso.command("/tmp/flyroll-sbx-probe", uid, 8, 16))
            if ok:
                iso = dataclasses.replace(iso, nested_userns=nested)
                if nested:
                    log.warning("sandbox: programs in the sandbox can create nested user namespaces, and with them mount "
                                "namespaces (kernel attack surface): %s (docs/sandbox.md)",
                                f"bwrap --disable-userns failed its probe ({refused})" if disables
                                else f"this bubblewrap (`{bwrap}`) has no --disable-userns, which needs 0.8 or later")
                return iso, ""
            refused = why
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
        ok, _, nested = _probe(list(prefix) + _setpriv(_random_uid()))
        if ok:
            return Isolation("root-ns", prefix, True, True, nested_userns=nested)
    if not root and unshare:
        for userflag in ("--map-current-user", "--map-root-user"):
            prefix = ("unshare", "--user", userflag, *_NS_FLAGS, "--")
            ok, _, nested = _probe(list(prefix))
            if ok:
                return Isolation("userns", prefix, False, True, nested_userns=nested)
    ok, _, nested = _probe(_setpriv(_random_uid())) if root and setpriv else (False, "", None)
    return Isolation("plain", (), ok, False, nested_userns=nested)


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
