"""Native-code and reward-hacking programs against engines/sandbox/runner.py.

Part 1 runs hostile programs with `audit_hook=False`, so that `ctypes` loads and calls libc
`open`/`write`/`socket`/`connect`/`fork`/`setsid` directly: only the kernel layers (bubblewrap's
read-only view and namespaces, the uid, the rlimits, the host-side kill) stand in the way.
Part 2 runs failing solutions that try to pass anyway (patched builtins, helpers and `__import__`,
always-equal objects, early exits, forged reports, frame walking, reading the tests), each with
the audit hook on, as in the code reward. Part 3: legitimate programs that must keep passing.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from engines.sandbox.isolation import isolation
from engines.sandbox.runner import run_program

REPO = Path(__file__).resolve().parents[3]


from tests.support.sandbox_procs import no_leftovers, sandbox_pids  # noqa: E402,F401 -- autouse fixture


# the bubblewrap layer needs a working `bwrap` (isolation() logs why when its probe fails)
needs_fs_view = pytest.mark.skipif(
    shutil.which("bwrap") is None or not isolation().fs_view,
    reason="no bubblewrap layer on this host (bwrap missing or its probe failed; isolation() logged "
           "which); bash infra/test.sh installs bwrap")

LIBC = textwrap.dedent("""
    import ctypes, ctypes.util, os
    libc = ctypes.CDLL(None, use_errno=True)
    def err():
        return os.strerror(ctypes.get_errno())
""")


# --- part 1: native code, audit hook off -------------------------------------------------------

@needs_fs_view
def test_libc_open_write_cannot_create_files_outside_the_scratch_dir():
    tag = "flyroll-escape-" + secrets.token_hex(4)
    targets = [f"/tmp/{tag}", f"/dev/shm/{tag}", f"/var/tmp/{tag}", str(REPO / tag),
               os.path.join(os.path.expanduser("~"), tag), f"/{tag}"]
    code = LIBC + textwrap.dedent(f"""
        for path in {targets!r} + ["inside.txt"]:
            fd = libc.open(path.encode(), os.O_WRONLY | os.O_CREAT, 0o666)
            n = libc.write(fd, b"pwned", 5) if fd >= 0 else -1
            print(path, "fd", fd, "wrote", n, "" if n == 5 else err())
        print("mkdir", libc.mkdir({str(REPO / tag)!r}.encode(), 0o777), err())
    """)
    v = run_program(code, timeout_s=5, audit_hook=False)
    assert v.verdict == "passed", v
    assert re.search(r"^inside.txt fd \d+ wrote 5", v.stdout, re.M), v.stdout   # scratch is writable
    assert f"/tmp/{tag} fd" in v.stdout and re.search(r"Read-only file system|Permission denied|No such file", v.stdout)  # it tried and was refused
    for t in targets:
        assert not os.path.exists(t), f"{t} was created on the host"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap missing; bash infra/test.sh installs it")
def test_an_interpreter_under_tmp_keeps_the_bubblewrap_layer(tmp_path):
    """A checkout under /tmp (as a CI clone may be) puts its venv under the sandbox's private /tmp:
    the install is bound back read-only, so the sandbox still runs it under bubblewrap."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (tmp_path / "hostile.py").write_text(LIBC + f"fd = libc.open({str(venv / 'planted')!r}.encode(), os.O_WRONLY | os.O_CREAT, 0o666)\nprint(fd, err())\n")
    probe = ("from engines.sandbox.runner import isolation, run_program\n"
             "v = run_program(open('hostile.py').read(), timeout_s=5, audit_hook=False)\n"
             "print(isolation().mode, isolation().fs_view, v.verdict, v.stdout.strip())\n")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    mode, fs_view, verdict, out = r.stdout.split(maxsplit=3)
    assert mode.startswith("bwrap") and fs_view == "True" and verdict == "passed", r.stdout + r.stderr[-2000:]
    assert out.startswith("-1") and not (venv / "planted").exists(), out   # the bound install is read-only


@needs_fs_view
def test_libc_socket_cannot_reach_a_host_listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    unix_path = f"/tmp/flyroll-escape-{secrets.token_hex(4)}.sock"
    usrv = socket.socket(socket.AF_UNIX)
    usrv.bind(unix_path)
    os.chmod(unix_path, 0o777)
    usrv.listen()
    abstract = b"\0flyroll-escape-" + secrets.token_hex(4).encode()
    asrv = socket.socket(socket.AF_UNIX)
    asrv.bind(abstract)
    asrv.listen()
    hits = []

    def accept(s):
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                hits.append(s.accept()[0].recv(10))
            except OSError:
                pass

    stop = threading.Event()
    threads = [threading.Thread(target=accept, args=(s,), daemon=True) for s in (srv, usrv, asrv)]
    for t in threads:
        t.start()
    port = srv.getsockname()[1]
    code = LIBC + textwrap.dedent(f"""
        import struct
        sin = struct.pack("=HH4s8x", 2, {port} >> 8 | ({port} & 255) << 8, bytes([127, 0, 0, 1]))
        fd = libc.socket(2, 1, 0)
        print("inet socket", fd, "connect", libc.connect(fd, sin, len(sin)), err())
        for name in ({unix_path.encode()!r}, {abstract!r}):
            sun = struct.pack("=H", 1) + name
            fd = libc.socket(1, 1, 0)
            r = libc.connect(fd, sun, len(sun))
            print("unix connect", r, err(), libc.write(fd, b"hi", 2) if r == 0 else "")
    """)
    try:
        v = run_program(code, timeout_s=5, audit_hook=False)
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(2)
        for s in (srv, usrv, asrv):
            s.close()
        os.unlink(unix_path)
    assert v.verdict == "passed", v
    assert re.search(r"^inet socket \d+ connect -1", v.stdout, re.M), v.stdout
    assert v.stdout.count("unix connect -1") == 2, v.stdout
    assert hits == []


def test_libc_double_fork_daemon_does_not_survive_the_run(no_leftovers):
    if not isolation().pidns:
        pytest.skip(f"no PID namespace on this host (mode {isolation().mode})")
    code = LIBC + textwrap.dedent("""
        import time
        if libc.fork() == 0:
            libc.setsid()
            if libc.fork() == 0:
                os.chdir("/")
                libc.signal(1, 1)          # SIGHUP ignored
                libc.signal(15, 1)         # SIGTERM ignored
                time.sleep(60)
            os._exit(0)
        time.sleep(0.3)
        print("parent done")
    """)
    v = run_program(code, timeout_s=5, audit_hook=False)
    assert v.verdict == "passed" and v.stdout == "parent done\n", v
    # the autouse fixture checks that no process of this run's uid is alive; a second look later:
    time.sleep(0.5)
    assert no_leftovers and not sandbox_pids(no_leftovers)


def test_native_code_cannot_forge_a_pass():
    """With ctypes and no hook: write forged reports to every fd it has, to its parent's and to
    PID 1's fds through /proc, ptrace its parent: the failing solution stays failing."""
    code = LIBC + textwrap.dedent("""
        import json
        def f():
            return 0
        lines = b"".join((json.dumps({"event": e, "nonce": "x", "passed": 1, "total": 1, "ok": True,
                                      "code": 0}) + "\\n").encode() for e in ("test", "done", "exit"))
        for pid in ("self", str(os.getppid()), "1"):
            try:
                fds = os.listdir("/proc/%s/fd" % pid)
            except OSError as e:
                print("listdir", pid, e.errno)
                continue
            for fd in fds:
                try:
                    w = os.open("/proc/%s/fd/%s" % (pid, fd), os.O_WRONLY | os.O_NONBLOCK)
                    os.write(w, lines)
                except OSError:
                    pass
        print("ptrace", libc.ptrace(16, os.getppid(), 0, 0), err())    # PTRACE_ATTACH
    """)
    v = run_program(code, tests=["assert f() == 1"], timeout_s=5, audit_hook=False)
    assert v.verdict != "passed" and v.tests_passed == 0, v
    assert "ptrace -1" in v.stdout


# --- part 2: failing solutions that try to pass (audit hook on) --------------------------------

HACKS = {
    "patched builtins": ("import builtins\nbuiltins.len = lambda x: 3\nbuiltins.isinstance = lambda *a: True\n"
                         "builtins.print = lambda *a, **k: None\ndef f():\n    return []\n",
                         ["assert len(f()) == 3", "assert isinstance(f(), int)"]),
    "patched len": ("import builtins\nbuiltins.len = lambda x: 3\ndef f():\n    return []\n",
                    ["assert len(f()) == 3"]),
    "shadowed builtins": ("def len(x):\n    return 3\ndef f():\n    return []\n", ["assert len(f()) == 3"]),
    "patched __import__": ("import builtins, types\nreal = builtins.__import__\n"
                           "fake = types.SimpleNamespace(isclose=lambda *a, **k: True)\n"
                           "builtins.__import__ = lambda n, *a, **k: fake if n == 'math' else real(n, *a, **k)\n"
                           "def f():\n    return 0.0\n",
                           "import math\nassert math.isclose(f(), 2.5)\n"),
    "patched math.isclose": ("import math\nmath.isclose = lambda *a, **k: True\ndef f():\n    return 0.0\n",
                             "import math\nassert math.isclose(f(), 2.5)\n"),
    "patched operator.eq": ("import operator\noperator.eq = lambda a, b: True\ndef f():\n    return 0\n",
                            "import operator\nassert operator.eq(f(), 3)\n"),
    "patched TestCase.assertEqual": ("import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"
                                     "def f():\n    return 0\n",
                                     "import unittest\nunittest.TestCase().assertEqual(f(), 3)\n"),
    "patched at call time": ("def f(x):\n    import math\n    math.isclose = lambda *a, **k: True\n    return 0.0\n",
                             "import math\nf(1)\nassert math.isclose(f(2), 2.5)\n"),
    "always-equal object": ("class Eq:\n    def __eq__(self, o):\n        return True\n    __hash__ = object.__hash__\n"
                            "def f():\n    return Eq()\n",
                            ["assert f() == 3", "assert f() == [1, 2]", "assert [f()] == [3]"]),
    "always-equal int subclass": ("class I(int):\n    def __eq__(self, o):\n        return True\n"
                                  "    __hash__ = int.__hash__\ndef f():\n    return I(0)\n",
                                  ["assert f() == 3"]),
    "exit inside the candidate": ("import os\ndef f():\n    os._exit(0)\n", ["assert f() == 3"]),
    "sys.exit inside the candidate": ("import sys\ndef f():\n    sys.exit(0)\n", ["assert f() == 3"]),
    "forged lines on every fd": ("import os, json\ndef f():\n    line = json.dumps({'event': 'done', 'passed': 1, 'total': 1})\n"
                                 "    for fd in map(int, os.listdir('/proc/self/fd')):\n"
                                 "        try:\n            os.write(fd, (line + '\\n').encode())\n"
                                 "        except OSError:\n            pass\n    return 0\n"
                                 "print('{\"verdict\": \"passed\"}')\n",
                                 ["assert f() == 3"]),
    "frame walking for the nonce": (
        "import sys, os\nf = lambda: 0\nfr = sys._getframe()\nwhile fr is not None:\n"
        "    loc = fr.f_locals\n    if 'nonce' in loc and 'report' in loc:\n"
        "        loc['report']('test', nonce=loc['nonce'], ok=True)\n"
        "        loc['report']('done', nonce=loc['nonce'], passed=1, total=1)\n        os._exit(0)\n"
        "    fr = fr.f_back\n",
        ["assert f() == 1"]),
}


@pytest.mark.parametrize("name", list(HACKS))
def test_failing_solution_cannot_pass(name):
    code, tests = HACKS[name]
    v = run_program(code, tests=tests, timeout_s=5)
    assert v.verdict != "passed", (name, v)
    assert v.tests_passed == 0, (name, v)


def test_the_program_cannot_read_the_tests():
    """The expected answer is only in the tests: neither gc nor /proc gives it to the program."""
    answer = "answer-" + secrets.token_hex(8)
    code = textwrap.dedent("""
        import gc, os
        def f():
            for o in gc.get_objects():
                for s in (o if isinstance(o, (tuple, list)) else [o]):
                    if isinstance(s, str) and s.startswith("answer-") and len(s) == 23:
                        return s
            for pid in os.listdir("/proc"):
                for part in ("cmdline", "environ"):
                    try:
                        data = open("/proc/%s/%s" % (pid, part), "rb").read().decode(errors="replace")
                    except OSError:
                        continue
                    i = data.find("answer-")
                    if i >= 0:
                        return data[i:i + 23]
            return None
    """)
    v = run_program(code, tests=[f"assert f() == {answer!r}"], timeout_s=5)
    assert v.verdict == "failed" and answer not in v.stdout + v.stderr, v


# --- part 3: legitimate programs keep working ----------------------------------------------------

def test_legitimate_programs_still_pass():
    code = textwrap.dedent("""
        import math, collections
        from fractions import Fraction
        N = 5
        Point = collections.namedtuple("Point", "x y")
        def sort_in_place(a):
            a.sort()
        def gen(n):
            yield from range(n)
        def third():
            return Fraction(1, 3)
        def point():
            return Point(1, 2)
        def fail(x):
            raise ValueError("bad %s" % x)
        class Solution:
            def twoSum(self, nums, target):
                seen = {}
                for i, v in enumerate(nums):
                    if target - v in seen:
                        return [seen[target - v], i]
                    seen[v] = i
        def counts(s):
            return collections.Counter(s)
    """)
    tests = textwrap.dedent("""
        from fractions import Fraction
        assert N == 5 and math.floor(2.5) == 2
        x = [3, 1, 2]
        sort_in_place(x)
        assert x == [1, 2, 3]
        assert list(gen(3)) == [0, 1, 2]
        assert third() == Fraction(1, 3)
        assert point() == (1, 2)
        try:
            fail(1)
        except ValueError as e:
            assert "bad 1" in str(e)
        else:
            assert False
        assert Solution().twoSum([2, 7, 11], 9) == [0, 1]
        assert counts("aab") == {"a": 2, "b": 1}
    """)
    v = run_program(code, tests=tests, timeout_s=10)
    assert v.verdict == "passed", v.stderr
    assert v.tests_passed == v.tests_total == 7


def test_passing_a_test_function_to_the_program_fails_clearly():
    v = run_program("def apply(fn, x):\n    return fn(x)\n", tests=["assert apply(lambda x: x + 1, 1) == 2"], timeout_s=5)
    assert v.verdict == "failed" and "cannot be passed to the program" in v.stderr


# --- fail closed without bubblewrap ---------------------------------------------------------------

def _without_bwrap(tmp_path, script: str) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter whose PATH has unshare and setpriv but no bwrap."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for tool in ("unshare", "setpriv", "mount"):
        found = shutil.which(tool)
        if found and not (bindir / tool).exists():
            (bindir / tool).symlink_to(found)
    return subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig()\n" + script],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "PATH": str(bindir)})


def test_without_bwrap_model_code_is_refused(tmp_path):
    """No bubblewrap and no weaker mode allowed by name: nothing runs, the error says why and the fix."""
    tag = f"/tmp/flyroll-refused-{secrets.token_hex(4)}"
    write = f"open({tag!r}, 'w')"
    r = _without_bwrap(tmp_path, "from engines.sandbox.runner import run_program, SandboxUnavailable\n"
                                 "try:\n"
                                 f"    run_program({write!r}, timeout_s=5)\n"
                                 "except SandboxUnavailable as e:\n"
                                 "    print('refused:', e)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("refused:"), r.stdout + r.stderr
    assert "bubblewrap (`bwrap`) is not on PATH" in r.stdout and "apt-get install bubblewrap" in r.stdout
    assert "allow_weaker" in r.stdout and not os.path.exists(tag)


def test_weaker_mode_allowed_by_name_runs_contained_and_says_so(tmp_path):
    """allow_weaker="rlimits-only": one warning naming the mode; programs run; the hook's refusals are
    verdicts there; the work dir is gone afterwards; the verdict says which mode ran it."""
    tag = f"/tmp/flyroll-weaker-{secrets.token_hex(4)}"
    write, many = f"open({tag!r}, 'w')", "for i in range(300):\n    open(str(i), 'w').close()"
    script = ("import glob\nfrom engines.sandbox.runner import run_program, isolation\n"
              "a = run_program('print(1)', timeout_s=5, allow_weaker='rlimits-only')\n"
              f"b = run_program({write!r}, timeout_s=5, allow_weaker='rlimits-only')\n"
              f"c = run_program({many!r}, timeout_s=5, "
              "allow_weaker='rlimits-only', max_files=100)\n"
              "print(a.verdict, a.isolation, b.verdict, c.verdict, isolation().fs_view)\n")
    r = _without_bwrap(tmp_path, script)
    assert r.returncode == 0, r.stderr
    verdicts = r.stdout.split()
    assert verdicts[0] == "passed" and verdicts[1] in ("root-ns", "userns", "plain"), r.stdout
    assert verdicts[2:] == ["forbidden", "disk", "False"], r.stdout + r.stderr[-2000:]
    assert r.stderr.count("WARNING") == 1 and "allowed by allow_weaker='rlimits-only'" in r.stderr, r.stderr
    assert not os.path.exists(tag)
    r = _without_bwrap(tmp_path, "from engines.sandbox.runner import run_program, SandboxUnavailable\n"
                                 "try:\n    run_program('print(1)', timeout_s=5, allow_weaker='namespaces')\n"
                                 "    print('ran')\nexcept SandboxUnavailable as e:\n    print('refused')\n")
    assert r.stdout.strip() in ("ran", "refused"), r.stderr   # "namespaces" admits root-ns/userns, never plain


# --- issue 41: disk budget, host-side robustness, the hook switched off, TMPDIR ---------------------

def _host_free_bytes() -> int:
    st = os.statvfs(REPO)
    return st.f_bavail * st.f_frsize


@needs_fs_view
def test_disk_budget_gives_a_clear_verdict_and_spares_the_host():
    """2 GB attempted past a 32 MiB budget (files of 16 MiB each, under max_file_mb): 'disk', and the
    host's disks (the repository's, /tmp's) lose no more than the budget while it runs."""
    code = textwrap.dedent("""
        i = 0
        while i < 128:
            with open("f%d" % i, "wb") as f:
                f.write(b"x" * (16 << 20))
            i += 1
    """)
    before = {p: os.statvfs(p) for p in (str(REPO), "/tmp", "/var/tmp")}
    v = run_program(code, timeout_s=10, max_disk_mb=32, max_file_mb=16, memory_mb=512)
    assert v.verdict == "disk", v
    assert "No space left on device" in v.stderr and "reached its budget" in v.stderr
    for p, st in before.items():
        now = os.statvfs(p)
        assert (st.f_bavail - now.f_bavail) * now.f_frsize < 32 << 20 or st.f_bavail <= now.f_bavail, p
    v = run_program("for i in range(5000):\n    open(str(i), 'w').close()", timeout_s=10, max_files=1000)
    assert v.verdict == "disk" and "files and dirs" in v.stderr, v
    v = run_program("open('ok', 'wb').write(b'x' * (1 << 20))", timeout_s=10, max_disk_mb=32, max_files=1000)
    assert v.verdict == "passed", v                 # within the budget: nothing changes


HOOK_OFF = textwrap.dedent("""
    import gc, threading
    # the audit hook skips every check while its thread-local "busy" flag is set: find it through gc
    for o in gc.get_objects():
        if type(o) is threading.local:
            o.busy = True
""")
HOSTILE_TRIES = textwrap.dedent("""
    import os, socket, subprocess
    for act in (lambda: open(TARGET, "w").write("pwned"), lambda: os.mkdir(TARGET + ".d"),
                lambda: socket.create_connection(("127.0.0.1", 9), timeout=1),
                lambda: open(os.path.expanduser("~root/.bashrc"), "a").write("pwned")):
        try:
            act()
        except Exception:
            pass
    def f(x):
        return x + 1
""")


@needs_fs_view
def test_audit_hook_switched_off_through_gc_changes_no_verdict(tmp_path):
    """A program that switches the hook off through gc, then tries writes outside and a connection,
    gets the verdict the same program gets with the hook on, and nothing lands outside."""
    target = str(REPO / f"flyroll-gc-{secrets.token_hex(4)}")
    probe = HOOK_OFF + "open('/etc/flyroll-gc-probe', 'w')\n"
    v = run_program(probe, timeout_s=5)           # the hook is really off: the kernel answers, not the hook
    assert "Read-only file system" in v.stderr and "audit hook refused" not in v.stderr, v
    tries = f"TARGET = {target!r}\n" + HOSTILE_TRIES
    for tests in (["assert f(1) == 2"], ["assert f(1) == 3"]):
        on = run_program(tries, tests=tests, timeout_s=5)
        off = run_program(HOOK_OFF + tries, tests=tests, timeout_s=5)
        assert on.verdict == off.verdict and (on.tests_passed, on.tests_total) == (off.tests_passed, off.tests_total), (on, off)
        assert "audit hook refused" in on.stderr and "audit hook refused" not in off.stderr
    uncaught = f"open({target!r}, 'w')\n"
    assert run_program(uncaught, timeout_s=5).verdict == run_program(HOOK_OFF + uncaught, timeout_s=5).verdict == "crashed"
    for p in (target, target + ".d", "/etc/flyroll-gc-probe"):
        assert not os.path.exists(p), p


def test_tempfile_works_under_a_private_host_tmpdir(tmp_path, monkeypatch):
    """The host's TMPDIR is a private (0700) folder: inside, TMPDIR is a folder of the work dir."""
    private = tmp_path / "private-tmp"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("TMPDIR", str(private))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    code = textwrap.dedent("""
        import os, tempfile
        with tempfile.TemporaryDirectory() as d, tempfile.NamedTemporaryFile("w", dir=d, delete=False) as f:
            f.write("ok")
        fd, p = tempfile.mkstemp()
        os.write(fd, b"x"); os.close(fd)
        def where():
            return os.path.dirname(p) == os.environ["TMPDIR"] == tempfile.gettempdir()
    """)
    v = run_program(code, tests=["assert where()"], timeout_s=5)
    assert v.verdict == "passed", v
    assert os.listdir(private) == []
