"""What runs inside the code sandbox (engines/sandbox.py), as `python -I -B -c <this file's text>`.

Self-contained on purpose: the sandboxed interpreter sees neither this package nor the caller's
environment, so this file imports only the standard library and is never imported by flyroll (the
host reads its text). argv: the fds of the config pipe and of the report pipe.
"""
import json, os, resource, sys

def _main():
    cfg_fd, rep_fd = int(sys.argv[1]), int(sys.argv[2])
    chunks = []
    while True:
        b = os.read(cfg_fd, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(cfg_fd)
    cfg = json.loads(b"".join(chunks))
    nonce = cfg.pop("nonce")

    def report(event, **kw):
        kw["event"] = event
        try:
            os.write(rep_fd, (json.dumps(kw) + "\n").encode())
        except OSError:
            pass

    for name, soft, hard in cfg["rlimits"]:
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (ValueError, OSError) as e:
            report("setup_error", what="setrlimit %s: %s" % (name, e))
            os._exit(70)

    # Supervisor: fork the worker, wait, report its status. In a PID namespace this process is
    # init, so the kernel kills every other sandbox process when it exits.
    try:
        worker = os.fork()
    except OSError as e:
        report("setup_error", what="fork worker: %s" % e)
        os._exit(70)
    if worker:
        while True:
            try:
                pid, status, ru = os.wait4(worker, 0)
                break
            except InterruptedError:
                continue
        if os.WIFSIGNALED(status):
            code = -os.WTERMSIG(status)
        else:
            code = os.WEXITSTATUS(status)
        report("exit", nonce=nonce, code=code, maxrss_kb=ru.ru_maxrss,
               cpu_s=ru.ru_utime + ru.ru_stime)
        os._exit(code if code >= 0 else 128 - code)
    _worker(cfg, nonce, report)


def _worker(cfg, nonce, report):
    import _posixsubprocess, socket, threading, traceback
    work = os.path.realpath(cfg["workdir"])
    secret = tuple(cfg["secret_paths"])
    in_pidns = cfg["pidns"]
    budget = [cfg["fork_budget"]]
    blocked_imports = {"ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixsubprocess"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    dev_ok = ("/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty", "/dev/zero")
    path_events = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
                   "os.utime", "os.mkfifo", "os.mknod", "os.chflags", "os.lchflags",
                   "os.setxattr", "os.removexattr", "shutil.rmtree", "os.chroot"}
    two_path_events = {"os.rename", "os.link", "os.symlink", "shutil.copyfile", "shutil.copytree",
                       "shutil.move"}
    exec_events = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
                   "pty.spawn", "os.startfile"}
    net_events = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
                  "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
                  "socket.getnameinfo"}
    local = threading.local()

    def forbid(what):
        report("forbidden", what=str(what)[:300])
        raise PermissionError("sandbox: forbidden: %s" % (what,))

    def resolve(p):
        p = os.fsdecode(p)
        return os.path.realpath(os.path.join(os.getcwd(), p))

    def inside(p):
        if isinstance(p, int):
            return True
        raw = os.path.normpath(os.path.join(os.getcwd(), os.fsdecode(p)))
        if raw in dev_ok or raw.startswith("/proc/self/fd/"):
            return True
        r = resolve(p)
        return r == work or r.startswith(work + os.sep)

    def is_descendant(pid):
        me = os.getpid()
        for _ in range(64):
            if pid == me:
                return True
            if pid <= 1:
                return False
            try:
                with open("/proc/%d/stat" % pid) as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return False
        return False

    def check_read(p):
        r = resolve(p)
        if any(r == s or r.startswith(s + os.sep) for s in secret):
            forbid("read %s" % r)
        if not in_pidns and r.startswith("/proc/"):
            part = r.split("/")[2]
            if part.isdigit() and int(part) != os.getpid():
                forbid("read %s" % r)

    def check(event, args):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            writing = bool(mode and any(c in mode for c in "wax+")) or bool(flags and flags & write_flags)
            if writing:
                if not inside(path):
                    forbid("write %s" % os.fsdecode(path))
            else:
                check_read(path)
        elif event in path_events:
            if args and not inside(args[0]):
                forbid("%s %s" % (event, args[0]))
        elif event in two_path_events:
            for p in args[:2]:
                if event == "os.symlink" and p is args[0]:
                    continue  # the link target may point anywhere; writes through it are checked
                if isinstance(p, (str, bytes, os.PathLike)) and not inside(p):
                    forbid("%s %s" % (event, p))
        elif event in ("os.fork", "os.forkpty"):
            if budget[0] <= 0:
                forbid("fork beyond the process limit")
            budget[0] -= 1
        elif event in exec_events:
            forbid("%s (running other programs)" % event)
        elif event == "os.kill":
            pid = args[0]
            if pid <= 0 or not is_descendant(pid):
                forbid("os.kill(%s) of a process outside the sandbox" % pid)
        elif event == "os.killpg":
            forbid("os.killpg(%s)" % args[0])
        elif event == "socket.__new__":
            if args[1] != socket.AF_UNIX:
                forbid("socket(family=%s)" % args[1])
        elif event in net_events:
            forbid("%s %r" % (event, args[:2]))
        elif event == "import":
            if args[0].split(".")[0] in blocked_imports:
                forbid("import %s" % args[0])

    def hook(event, args):
        if getattr(local, "busy", False):
            return
        local.busy = True
        try:
            check(event, args)
        finally:
            local.busy = False

    def no_fork_exec(*a, **k):
        forbid("_posixsubprocess.fork_exec (running other programs)")

    os.register_at_fork(after_in_child=lambda: budget.__setitem__(0, 0))
    src_name = os.path.join(work, "program.py")
    try:
        program = compile(cfg["program"], src_name, "exec")
        tests = [(compile(src, "<tests>", "exec"), kind) for src, kind in cfg["tests"] or []]
    except (SyntaxError, ValueError):
        traceback.print_exc()
        report("program_error", nonce=nonce, what="syntax")
        sys.exit(1)
    main = type(sys)("__main__")          # a fresh __main__, so pickle finds the program's names
    main.__file__, main.__builtins__ = src_name, __builtins__
    sys.modules["__main__"] = main
    glb = main.__dict__
    sys.argv = [src_name]
    sys.dont_write_bytecode = True
    def no_new_session(*a, **k):
        forbid("leaving the process group (setsid/setpgid)")

    _posixsubprocess.fork_exec = no_fork_exec
    import posix
    for mod in (os, posix):     # keep every process in the group the host SIGKILLs
        mod.setsid = mod.setpgid = mod.setpgrp = no_new_session
    cfg = None
    sys.addaudithook(hook)

    try:
        exec(program, glb)
    except SystemExit as e:
        if e.code not in (None, 0) or not tests:
            raise
    except MemoryError:
        report("memory", nonce=nonce)
        sys.stderr.write("MemoryError\n")
        os._exit(1)
    except BaseException:
        traceback.print_exc()
        report("program_error", nonce=nonce)
        sys.stderr.flush()
        os._exit(1)
    if not tests:
        return
    passed, total, broken = 0, sum(k == "test" for _, k in tests), False
    for i, (code, kind) in enumerate(tests):
        if broken:
            break
        try:
            exec(code, glb)
        except MemoryError:
            report("memory", nonce=nonce)
            broken = kind == "setup"
        except BaseException as e:
            sys.stderr.write("test %d failed: %s: %s\n" % (i, type(e).__name__, str(e)[:500]))
            broken = kind == "setup"
        else:
            if kind == "test":
                passed += 1
                report("test", nonce=nonce, ok=True)
    sys.stdout.flush()
    report("done", nonce=nonce, passed=passed, total=total)

if __name__ == "__main__":
    _main()
