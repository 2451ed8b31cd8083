# longer than 400 lines: the sandbox supervisor: one security boundary, read as one file
"""Run model-written Python in a sandbox and return a `Verdict`.

Every program runs in a fresh process tree, in its own session, in a fresh temporary working
directory, with a scrubbed environment, and is SIGKILLed (with everything it started) at the
wall-clock timeout. The layers, strongest first (docs/sandbox.md says what each one stops and
what none of them stops):

1. bubblewrap (`bwrap`): the host filesystem read-only, private /tmp and /dev/shm, the work dir a
   tmpfs of max_disk_mb (and max_files inodes as root) inside the sandbox, no host path writable,
   the host HOME hidden; new network (no route to the host), PID, IPC, UTS and cgroup namespaces;
   killed with the host process; no nested user (nor mount) namespace where bwrap has
   --disable-userns (0.8+; otherwise one warning says so). Without bwrap, model code does not
   run (`SandboxUnavailable`) unless `allow_weaker` names a weaker mode: util-linux `unshare`
   (network, PID, mount + /proc) or nothing ("plain"), after ONE warning.
2. Kernel credentials, when the host runs as root: `setpriv` drops to a random unprivileged uid/gid
   with no supplementary groups and no_new_privs.
3. Kernel resource limits (`setrlimit` in the sandbox before any model code runs): CPU seconds,
   address space, file size, process count, no core files, open files.
4. The host side: wall-clock timeout, SIGKILL of the process group and of every process of the
   sandbox uid, stdout/stderr read incrementally and capped, the work dir removed.
5. A separate test harness: the supervisor runs the tests in its own interpreter against proxies
   of the program's names, so nothing the program patches or returns can fake a pass, and only
   the supervisor holds the report pipe the verdict is read from.
6. An audit hook (PEP 578) in the program process: refuses writes outside the work dir, running
   other programs, forking beyond the budget, sockets, signals to foreign processes, reading
   credential files, and importing ctypes. The program can switch it off (native code, or `gc`
   to its state), so under bubblewrap it is defence in depth and decides no verdict; layers 1-5
   hold on their own. Without bubblewrap its refusals give the verdict "forbidden".

The sandboxed interpreter is `python -I -B -c <engines/sandbox/child.py>`: the supervisor sets
the limits, forks the program process, and reports its exit status, the test results and a
per-run nonce on a private report pipe; the program process's own reports (forbidden, memory,
crash) arrive on a second pipe that can only turn a run into a non-pass.

    flyroll sandbox PROGRAM.py [--tests TESTS.py] [--timeout S] [--memory-mb M]
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from engines.sandbox.isolation import (_SECRET_HOME_PATHS, WEAKER_MODES, Isolation, SandboxUnavailable, _kill_uid,
                                       _random_uid, _tasks_of_uid, isolation, require_isolation)
from engines.sandbox.tree_removal import remove_tree

__all__ = ["Verdict", "SandboxUnavailable", "configure", "isolation", "remove_tree", "require_isolation", "run_program",
           "split_tests"]

VERDICTS = ("passed", "failed", "timeout", "memory", "disk", "crashed", "forbidden")


@dataclasses.dataclass
class SandboxPolicy:
    """Process-wide defaults of `run_program` (the reward worker sets them from config
    `reward.sandbox` through `configure`): the weaker isolation allowed by name (None: bubblewrap
    only, fail closed), the work dir's size and file budget."""

    allow_weaker: str | None = None
    max_disk_mb: int = 256
    max_files: int = 10_000


POLICY = SandboxPolicy()


def configure(allow_weaker: str | None = None, max_disk_mb: int = 256, max_files: int = 10_000) -> None:
    """Set this process's sandbox policy (see `SandboxPolicy`); config `reward.sandbox`."""
    if allow_weaker is not None and allow_weaker not in WEAKER_MODES:
        raise ValueError(f"sandbox: allow_weaker={allow_weaker!r}, expected None or one of {sorted(WEAKER_MODES)}")
    if max_disk_mb < 1 or max_files < 1:
        raise ValueError(f"sandbox: max_disk_mb={max_disk_mb}, max_files={max_files}; expected positive numbers")
    POLICY.allow_weaker, POLICY.max_disk_mb, POLICY.max_files = allow_weaker, int(max_disk_mb), int(max_files)
_REPORT_CAP = 1 << 20          # bytes of report-pipe traffic kept; the rest is dropped

@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of one sandboxed run.

    verdict: passed    exit 0 and, with tests, every test passed
             failed    ran to the end but a test failed, or exited non-zero / before the tests ran
             timeout   wall clock or CPU limit exceeded (the whole process tree was killed)
             memory    MemoryError under the address-space limit, or killed by the OOM killer
             disk      the work dir reached its budget (max_disk_mb bytes or max_files files and dirs)
             crashed   uncaught exception in the program (not in a test), syntax error, or a fatal
                       signal (segfault, abort)
             forbidden the audit hook refused an operation (even if the program caught the error), in
                       the modes without bubblewrap only: under bubblewrap the kernel layers hold on
                       their own and the hook (which the program can switch off) decides no verdict
    isolation: the mode that ran it (`isolation().mode`).
    exit_code: the program's exit status; -N when it died of signal N; None when it never reported.
    tests_passed / tests_total: None without tests.
    """

    verdict: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    max_rss_mb: float
    tests_passed: int | None = None
    tests_total: int | None = None
    isolation: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


# ---------------------------------------------------------------------------------------------
# What runs inside the sandbox: engines/sandbox/child.py, passed as `python -I -B -c` text, so it
# sees neither this package nor the caller's environment.
_BOOTSTRAP = (Path(__file__).with_name("child.py")).read_text()


# ---------------------------------------------------------------------------------------------
def split_tests(tests: str | Sequence[str] | None) -> list[tuple[str, str]] | None:
    """Tests as [(source, kind)], kind "test" (counted) or "setup" (must not fail).

    A list: each element is one test. A string: its top-level `assert` statements are the tests
    and every other top-level statement is setup; a string without any top-level assert (e.g. a
    HumanEval `check(candidate)` harness) is one test.
    """
    if tests is None:
        return None
    if not isinstance(tests, str):
        return [(str(t), "test") for t in tests]
    try:
        tree = ast.parse(tests)
    except SyntaxError as e:
        raise ValueError(f"tests: not valid Python ({e.msg}, line {e.lineno}); expected assert "
                         "statements or a check(candidate) harness") from e
    if not any(isinstance(s, ast.Assert) for s in tree.body):
        return [(tests, "test")]
    lines = tests.splitlines(keepends=True)
    out = []
    for s in tree.body:
        start = s.lineno - 1 - len(getattr(s, "decorator_list", []))
        src = "".join(lines[start:s.end_lineno])
        out.append(("\n" * start + src, "test" if isinstance(s, ast.Assert) else "setup"))
    return out


def run_program(code: str, *, tests: str | Sequence[str] | None = None, stdin: str = "",
                timeout_s: float = 5.0, cpu_s: float | None = None, memory_mb: int = 512,
                max_output_bytes: int = 64_000, max_file_mb: int = 16,
                max_procs: int = 32, max_disk_mb: int | None = None, max_files: int | None = None,
                allow_weaker: str | None = None, audit_hook: bool = True) -> Verdict:
    """Run `code`, then `tests` against the names it defined, in the sandbox; never raises for
    anything the program does. Raises `SandboxUnavailable` (nothing runs) when bubblewrap cannot
    start and `allow_weaker` (default: `configure`'s, else None) names no mode this host has.
    `cpu_s` defaults to `timeout_s`; limits apply per process except `max_procs`, which caps
    processes + threads of the whole run (and the fork budget), and `max_disk_mb` / `max_files`
    (default: `configure`'s, 256 MiB / 10,000), the work dir's total.
    `audit_hook=False` leaves out the in-interpreter refusals (the audit hook and the setsid /
    fork_exec stubs) so that tests can check the kernel layers alone; rewards never pass it."""
    max_disk_mb = POLICY.max_disk_mb if max_disk_mb is None else max_disk_mb
    max_files = POLICY.max_files if max_files is None else max_files
    for name, v in (("timeout_s", timeout_s), ("memory_mb", memory_mb), ("max_output_bytes", max_output_bytes),
                    ("max_procs", max_procs), ("max_disk_mb", max_disk_mb), ("max_files", max_files)):
        if not v or v <= 0:
            raise ValueError(f"run_program: {name}={v!r}, expected a positive number")
    items = split_tests(tests)
    iso = require_isolation(allow_weaker if allow_weaker is not None else POLICY.allow_weaker)
    uid = _random_uid() if iso.drop_uid else None
    cpu = max(1, math.ceil(cpu_s if cpu_s is not None else timeout_s))
    if uid is not None or iso.mode in ("userns", "bwrap-userns"):
        nproc = max_procs + 1
    else:
        nproc = max_procs + 1 + _tasks_of_uid(os.getuid())
    rlimits = [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", memory_mb << 20, memory_mb << 20),
               ("RLIMIT_FSIZE", max_file_mb << 20, max_file_mb << 20), ("RLIMIT_NPROC", nproc, nproc),
               ("RLIMIT_CORE", 0, 0), ("RLIMIT_NOFILE", 256, 256)]
    home = os.path.expanduser("~")
    nonce = secrets.token_hex(16)
    # bubblewrap: the work dir exists only inside the sandbox (a tmpfs under its private /tmp); otherwise
    # a host dir (root-ns mounts a tmpfs over it in its own mount namespace, so it stays empty)
    host_dir = None if iso.fs_view else tempfile.mkdtemp(prefix="flyroll-sbx-", dir=_host_work_base(uid))
    workdir = host_dir or "/tmp/flyroll-sbx-" + secrets.token_hex(6)
    cfg = {"workdir": workdir, "program": code, "has_tests": items is not None, "rlimits": rlimits,
           "pidns": iso.pidns, "fork_budget": max_procs - 1, "audit_hook": bool(audit_hook),
           "secret_paths": [os.path.join(home, p) for p in _SECRET_HOME_PATHS],
           "disk": {"bytes": max_disk_mb << 20, "files": max_files, "tmpfs": iso.private_workdir}}
    secret = {"nonce": nonce, "tests": items}     # read by the supervisor only, after the fork
    v = None
    try:
        if host_dir is not None and uid is not None:
            os.chown(host_dir, uid, uid)
        total = None if items is None else sum(kind == "test" for _, kind in items)
        v = _run(cfg, secret, iso, uid, stdin, timeout_s, max_output_bytes, total, max_disk_mb, max_files)
    finally:
        if host_dir is not None:
            files, nbytes = remove_tree(host_dir)
            # no size-limited filesystem under a host work dir: the budget is checked here, afterwards
            if v is not None and v.verdict in ("passed", "failed", "crashed") and \
                    (files > max_files + 2 or nbytes > max_disk_mb << 20):
                v = dataclasses.replace(v, verdict="disk", stderr=v.stderr + (
                    f"\n[sandbox: the work dir held {files} entries, {nbytes >> 20} MiB; budget {max_files} "
                    f"files, {max_disk_mb} MiB]\n"))
    return v


def _host_work_base(uid: int | None) -> str:
    """Where a host work dir goes: `tempfile.gettempdir()`, unless the sandbox uid could not reach
    it (a private TMPDIR, mode 0700): then /tmp."""
    base = os.path.realpath(tempfile.gettempdir())
    if uid is None:
        return base
    p = base
    while p != "/":
        if not os.stat(p).st_mode & 0o001:
            return "/tmp"
        p = os.path.dirname(p)
    return base


def _run(cfg: dict, secret: dict, iso: Isolation, uid: int | None, stdin: str, timeout_s: float,
         cap: int, tests_total: int | None, max_disk_mb: int, max_files: int) -> Verdict:
    workdir, nonce = cfg["workdir"], secret["nonce"]
    cfg_r, cfg_w = os.pipe()
    sec_r, sec_w = os.pipe()
    rep_r, rep_w = os.pipe()      # supervisor -> host: the events that can make a run pass
    ev_r, ev_w = os.pipe()        # program process -> host: forbidden / memory / program_error
    cmd = [*iso.command(workdir, uid, max_disk_mb, max_files),
           sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(cfg_r), str(sec_r), str(rep_w), str(ev_w)]
    sandbox_ends = (cfg_r, sec_r, rep_w, ev_w)
    # TMPDIR: a folder of the work dir that the supervisor creates, whatever the host's TMPDIR
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
           "TMPDIR": os.path.join(workdir, "tmp")}
    with tempfile.TemporaryFile() as stdin_f:     # unlinked: the program sees it only as fd 0
        stdin_f.write(stdin.encode())
        stdin_f.seek(0)
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, stdin=stdin_f, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=sandbox_ends, cwd="/" if iso.fs_view else workdir, env=env,
                                    start_new_session=True)
        except BaseException:
            for fd in (*sandbox_ends, cfg_w, sec_w, rep_r, ev_r):
                os.close(fd)
            raise
        for fd in sandbox_ends:
            os.close(fd)
    for fd, blob in ((cfg_w, cfg), (sec_w, secret)):   # the secret only once the config is read
        try:
            _write_all(fd, json.dumps(blob).encode())
        except OSError:
            pass  # the sandbox died before reading it; its exit status says why
        finally:
            os.close(fd)

    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray(), rep_r: bytearray(), ev_r: bytearray()}
    caps = {out_fd: cap, err_fd: cap, rep_r: _REPORT_CAP, ev_r: _REPORT_CAP}
    dropped = dict.fromkeys(bufs, 0)
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)

    def pump(wait: float) -> None:
        if not sel.get_map():
            time.sleep(wait)
            return
        for key, _ in sel.select(wait):
            chunk = os.read(key.fd, 1 << 16)
            if not chunk:
                sel.unregister(key.fd)
                continue
            room = max(caps[key.fd] - len(bufs[key.fd]), 0)
            bufs[key.fd] += chunk[:room]
            dropped[key.fd] += len(chunk) - len(chunk[:room])

    deadline = t0 + timeout_s
    status, rusage, timed_out = None, None, False
    try:
        while True:
            pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status, rusage = st, ru
                break
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            pump(min(deadline - now, 0.02))
    except BaseException:   # e.g. SystemExit from the reward worker's SIGTERM (engines/rewards/calls.py): no orphans
        _kill_tree(proc.pid, uid)
        raise
    wall = time.monotonic() - t0
    _kill_tree(proc.pid, uid)
    if status is None:
        _, status, rusage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    drain_until = time.monotonic() + 1.0              # leftovers are dead: read what they wrote
    while sel.get_map() and time.monotonic() < drain_until:
        pump(0.05)
    sel.close()
    proc.stdout.close()
    proc.stderr.close()
    os.close(rep_r)
    os.close(ev_r)

    stderr = bytes(bufs[err_fd])
    if dropped[out_fd] or dropped[err_fd]:
        stderr += f"\n[sandbox: output truncated at {cap} bytes per stream]\n".encode()
    events = _parse_events(bytes(bufs[rep_r]), nonce) + _parse_program_events(bytes(bufs[ev_r]))
    exit_ev = next((e for e in events if e["event"] == "exit"), None)
    if exit_ev is not None:
        exit_code = exit_ev["code"]
    elif timed_out:
        exit_code = None
    else:
        exit_code = proc.returncode
    # The in-sandbox init measures the program's own peak (wait4 on the worker). The host-side rusage
    # of the launcher also counts the pages it shared with this (possibly large) process right after
    # fork, so it is only a fallback when the program died before reporting.
    max_rss_kb = exit_ev["maxrss_kb"] if exit_ev else rusage.ru_maxrss
    refused = [e.get("what", "") for e in events if e["event"] == "forbidden"]
    if iso.fs_view and refused:
        # the kernel layers hold on their own: what the hook refused (it raised in the program) is told,
        # not judged, since the program can switch the hook off and would then meet the kernel instead
        events = [e for e in events if e["event"] != "forbidden"]
        stderr += ("\n[sandbox: the audit hook refused: %s]\n" % "; ".join(map(str, refused[:5]))).encode()
    disk_ev = next((e for e in events if e["event"] == "disk"), None)
    if disk_ev is not None:
        stderr += (f"\n[sandbox: the work dir reached its budget ({disk_ev.get('what', '')}; "
                   f"max_disk_mb={max_disk_mb}, max_files={max_files})]\n").encode()
    verdict, passed = _decide(events, exit_code, timed_out, tests_total, stderr)
    return Verdict(verdict=verdict, exit_code=exit_code, isolation=iso.mode,
                   stdout=bufs[out_fd].decode("utf-8", "replace"),
                   stderr=stderr.decode("utf-8", "replace"),
                   wall_s=round(wall, 4), max_rss_mb=round(max_rss_kb / 1024, 2),
                   tests_passed=passed, tests_total=tests_total)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _kill_tree(pid: int, uid: int | None) -> None:
    """SIGKILL the sandbox's session and, when it has its own uid, every process of that uid
    (catches children that left the session). In a PID namespace the kernel already killed the
    rest when the sandbox's init died."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        _kill_uid(uid)


def _json_lines(raw: bytes) -> list[dict]:
    events = []
    for line in raw.splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and "event" in e:
            events.append(e)
    return events


def _parse_events(raw: bytes, nonce: str) -> list[dict]:
    """Report-pipe lines -> events; events that need the nonce and lack it are dropped."""
    trusted = {"exit", "test", "done", "memory", "program_error", "disk"}
    return [e for e in _json_lines(raw) if e["event"] not in trusted or e.get("nonce") == nonce]


def _parse_program_events(raw: bytes) -> list[dict]:
    """Program-event pipe lines -> events. The program process can write anything here, so only
    kinds that can never make a run pass are kept."""
    events = []
    for e in _json_lines(raw):
        if e["event"] in ("forbidden", "memory", "program_error", "setup_error"):
            events.append({k: v for k, v in e.items() if k != "nonce"})
    return events


def _decide(events: list[dict], exit_code: int | None, timed_out: bool, tests_total: int | None,
            stderr: bytes) -> tuple[str, int | None]:
    kinds = {e["event"] for e in events}
    done = next((e for e in events if e["event"] == "done"), None)
    passed = None
    if tests_total is not None:
        passed = done["passed"] if done else sum(e["event"] == "test" for e in events)
    exit_ev = next((e for e in events if e["event"] == "exit"), None)
    if "forbidden" in kinds:
        return "forbidden", passed
    if timed_out or exit_code == -signal.SIGXCPU:
        return "timeout", passed
    if "memory" in kinds or (exit_code not in (0, None) and b"MemoryError" in stderr[-2000:]):
        return "memory", passed
    if "disk" in kinds:
        return "disk", passed
    if exit_code == -signal.SIGKILL:   # not by us: RLIMIT_CPU hard limit, else the OOM killer
        return ("timeout" if exit_ev and exit_ev.get("cpu_s", 0) >= 1 else "memory"), passed
    if exit_code is not None and exit_code < 0:
        return "crashed", passed
    if "program_error" in kinds or "setup_error" in kinds:
        return "crashed", passed
    if exit_code != 0:
        return "failed", passed
    if tests_total is not None:
        ok = done is not None and done["passed"] == done["total"] == tests_total
        return ("passed" if ok else "failed"), passed
    return "passed", passed


def cli_main(argv: list[str]) -> int:
    """`flyroll sandbox PROGRAM.py [--tests TESTS.py] [--timeout S] [--memory-mb M]`: print the
    verdict as one JSON object; exit 0 when it passed, 1 otherwise."""
    p = argparse.ArgumentParser(prog="flyroll sandbox", description=cli_main.__doc__.split(":")[0])
    p.add_argument("program", help="Python file to run")
    p.add_argument("--tests", help="Python file with assert statements or a check() harness, run after the program")
    p.add_argument("--stdin", help="file fed to the program's standard input")
    p.add_argument("--timeout", type=float, default=5.0, help="wall-clock limit in seconds (default 5)")
    p.add_argument("--memory-mb", type=int, default=512, help="address-space limit in MiB (default 512)")
    a = p.parse_args(argv)
    with open(a.program) as f:
        code = f.read()
    tests = open(a.tests).read() if a.tests else None
    stdin = open(a.stdin).read() if a.stdin else ""
    v = run_program(code, tests=tests, stdin=stdin, timeout_s=a.timeout, memory_mb=a.memory_mb)
    keys = ("verdict", "exit_code", "stdout", "stderr", "wall_s", "max_rss_mb")
    out = {k: getattr(v, k) for k in keys}
    if v.tests_total is not None:
        out.update(tests_passed=v.tests_passed, tests_total=v.tests_total)
    print(json.dumps(out))
    return 0 if v.verdict == "passed" else 1
