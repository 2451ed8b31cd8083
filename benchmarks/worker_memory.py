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
