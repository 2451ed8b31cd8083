"""Folders tests need: one this process cannot write into."""

from __future__ import annotations

import os

import pytest


def read_only_folder(tmp_path) -> str:
    """A folder this process cannot write into (as root a chmod does not stop writes: use /sys)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if not os.access(ro, os.W_OK):
        return str(ro / "store")
    try:
        open("/sys/.flyroll-probe", "w").close()
    except OSError:
        return "/sys/flyroll-store"
    os.remove("/sys/.flyroll-probe")
    pytest.skip("no read-only folder available")
