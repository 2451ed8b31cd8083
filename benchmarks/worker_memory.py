"""Shared by the two `flyroll bench` worker scripts (flyroll_grpo_step.py, trl_grpo_step.py), which run
in different environments; both find this file next to them on sys.path (the script's own folder)."""


def release_memory() -> None:
    """Give freed heap memory back to the OS (glibc keeps a step's peak otherwise), so an idle worker
    holds only its model and optimizer while the other system runs. Outside the timed step."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_gb() -> dict:
    """This process's resident memory now and its peak so far (GiB, /proc/self/status), or {} where
    there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            kb = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    except OSError:
        return {}
    return {"rss_gb": int(kb["VmRSS"].split()[0]) / 2**20, "peak_rss_gb": int(kb["VmHWM"].split()[0]) / 2**20}
