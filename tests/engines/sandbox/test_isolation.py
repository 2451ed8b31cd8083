"""engines/sandbox/isolation.py: where bubblewrap has `--disable-userns` (0.8+), a program in the sandbox
cannot create a nested user namespace, nor with it a mount namespace (native code, audit hook off);
where it has not, the sandbox still runs and says once that nested namespaces remain possible."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engines.sandbox import runner
from engines.sandbox.isolation import isolation
from engines.sandbox.runner import run_program

from tests.support.sandbox_procs import no_leftovers, sandbox_pids  # noqa: F401 -- autouse fixture

REPO = Path(__file__).resolve().parents[3]

# native code: libc unshare(2) by ctypes, then util-linux `unshare -U` as a subprocess
NESTED = textwrap.dedent("""
    import ctypes, errno, os, shutil, subprocess
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
    def attempt(name, flags):
        pid = os.fork()                    # in a child: a namespace made here must not change the next attempt
        if pid == 0:
            r = libc.unshare(flags)
            os._exit(0 if r == 0 else ctypes.get_errno())
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(name, "created" if code == 0 else "refused " + errno.errorcode.get(code, str(code)))
    attempt("user", CLONE_NEWUSER)
    attempt("user+mount", CLONE_NEWUSER | CLONE_NEWNS)
    attempt("mount", CLONE_NEWNS)
    if shutil.which("unshare"):
        r = subprocess.run(["unshare", "-U", "true"], capture_output=True, text=True)
        print("unshare-cmd", "created" if r.returncode == 0 else "refused " + r.stderr.strip().replace(" ", "_"))
    print("home", sorted(os.listdir(HOME)))
""")


def _nested_program() -> str:
    return f"HOME = {os.path.realpath(os.path.expanduser('~'))!r}\n" + NESTED


def _outcomes(stdout: str) -> dict[str, str]:
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in stdout.splitlines() if " " in line}


@pytest.mark.skipif(shutil.which("bwrap") is None or not isolation().fs_view,
                    reason="no bubblewrap layer on this host (bash infra/test.sh installs bwrap)")
def test_a_program_cannot_create_nested_user_or_mount_namespaces(monkeypatch):
    """Was: under bubblewrap a program (as root's sandbox uid, or bwrap's own user namespace before 0.8 or
    without --disable-userns) could unshare a user namespace, be root in it, and make mount namespaces: the
    kernel's namespace code became its attack surface. The same program with --disable-userns left out
    (the control) creates them here, so the refusal is the flag's doing."""
    iso = isolation()
    if not iso.userns_disabled:
        pytest.skip(f"this bubblewrap has no usable --disable-userns (0.8+; mode {iso.mode}): nested user "
                    "namespaces remain possible, which isolation() logged")
    assert iso.nested_userns is False                       # the probe measured it
    v = run_program(_nested_program(), timeout_s=10, audit_hook=False)
    got = _outcomes(v.stdout)
    assert v.verdict == "passed", v
    for name in ("user", "user+mount", "mount"):
        assert got[name].split()[0] == "refused" and got[name].split()[1] in ("EPERM", "ENOSPC", "EUSERS"), got
    if "unshare-cmd" in got:
        assert got["unshare-cmd"].startswith("refused"), got
    # the host HOME is hidden: only the way to the interpreter's install (pyenv in HOME) is there
    home = os.path.realpath(os.path.expanduser("~"))
    allowed = {p[len(home) + 1:].split(os.sep)[0] for p in (os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix))
               if p.startswith(home + os.sep)}
    assert set(eval(got["home"])) <= allowed, got["home"]

    monkeypatch.setattr(runner, "require_isolation", lambda *a, **k: dataclasses.replace(iso, userns_disabled=False))
    control = _outcomes(run_program(_nested_program(), timeout_s=10, audit_hook=False).stdout)
    if control["user"] != "created":
        pytest.skip(f"this kernel refuses user namespaces to the sandbox without --disable-userns too ({control})")
    assert control["user+mount"] == "created", control


def test_an_older_bubblewrap_still_runs_and_says_nested_namespaces_remain(tmp_path):
    """bubblewrap before 0.8 has no --disable-userns (its --help does not list it): the sandbox runs without
    it (nothing refuses to start), the probe measures that a program can create a user namespace, and one
    warning says so and names the version that fixes it."""
    real = shutil.which("bwrap")
    if real is None:
        pytest.skip("bwrap missing; bash infra/test.sh installs it")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "bwrap").write_text("#!/bin/sh\n"   # an 0.7-like bwrap: no --disable-userns in its help or its options
                                  f'if [ "$1" = --help ]; then {real} --help | grep -v -e --disable-userns; exit 0; fi\n'
                                  'for a in "$@"; do [ "$a" = --disable-userns ] && { echo "bwrap: Unknown option $a" >&2; exit 1; }; done\n'
                                  f'exec {real} "$@"\n')
    (bindir / "bwrap").chmod(0o755)
    script = ("import logging; logging.basicConfig()\n"
              "from engines.sandbox.runner import isolation, run_program\n"
              f"v = run_program({_nested_program()!r}, timeout_s=10, audit_hook=False)\n"
              "iso = isolation()\n"
              "print(iso.mode, iso.fs_view, iso.userns_disabled, iso.nested_userns, v.verdict)\n"
              "print(v.stdout)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"})
    assert r.returncode == 0, r.stderr
    head, _, body = r.stdout.partition("\n")
    mode, fs_view, disabled, nested, verdict = head.split()
    assert (fs_view, disabled, verdict) == ("True", "False", "passed"), r.stdout + r.stderr
    if nested == "True":       # the kernel lets the sandbox uid make user namespaces: so may the program, and it is said
        assert _outcomes(body)["user"] == "created", body
        assert r.stderr.count("WARNING") == 1 and "has no --disable-userns, which needs 0.8 or later" in r.stderr, r.stderr
    else:
        assert _outcomes(body)["user"].startswith("refused") and "WARNING" not in r.stderr, r.stdout + r.stderr
