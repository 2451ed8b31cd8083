"""`train`'s scratch checkpoint folders: named for the process that writes them, and removed at the
next training start once that process is gone (a run killed between train and publish_weights
otherwise left a whole checkpoint in the temp folder)."""

from __future__ import annotations

import os
import subprocess
import sys

from tasks.run.checkpoints import discard_scratch_checkpoint, reap_orphan_checkpoints, scratch_checkpoint_dir


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not os.path.exists(f"/proc/{p.pid}")
    return p.pid


def _fill(path, size=1024) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(os.urandom(size))


def test_a_killed_writers_checkpoint_is_reaped_and_a_live_ones_kept(tmp_path):
    dead = tmp_path / f"flyroll-ckpt-p{_dead_pid()}-i0003-abc123"
    live = tmp_path / f"flyroll-ckpt-p{os.getpid()}-i0002-def456"
    legacy = tmp_path / "flyroll-ckpt-0003-xyz"            # no writer pid in its name: not ours to judge
    other = tmp_path / "someone-else"
    for d in (dead, live, legacy, other):
        _fill(d)

    assert reap_orphan_checkpoints(str(tmp_path)) == [str(dead)]
    assert not dead.exists()
    assert live.exists() and legacy.exists() and other.exists()
    assert reap_orphan_checkpoints(str(tmp_path)) == []


def test_a_new_scratch_dir_names_this_process_and_reaps_first(tmp_path):
    dead = tmp_path / f"flyroll-ckpt-p{_dead_pid()}-i0001-aaa"
    _fill(dead)
    out = scratch_checkpoint_dir(7, parent=str(tmp_path))
    assert os.path.basename(out).startswith(f"flyroll-ckpt-p{os.getpid()}-i0007-")
    assert os.path.isdir(out) and not dead.exists()
    # the next iteration's start keeps this live process's folder (publish_weights has not run yet)
    nxt = scratch_checkpoint_dir(8, parent=str(tmp_path))
    assert os.path.isdir(out) and os.path.isdir(nxt)


def test_discard_removes_only_scratch_folders_in_the_temp_dir(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = scratch_checkpoint_dir(1)
    _fill(out)
    elsewhere = tmp_path / "nested" / os.path.basename(out)   # same name, not in the temp dir itself
    _fill(elsewhere)
    discard_scratch_checkpoint(out)
    discard_scratch_checkpoint(str(elsewhere))
    assert not os.path.exists(out) and elsewhere.exists()
