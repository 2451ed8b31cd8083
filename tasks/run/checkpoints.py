"""Scratch checkpoints: the local folder `train` writes a new policy version into and
`publish_weights` removes once the artifact store holds it (tasks/stages/training.py, tasks/stages/weight_sync.py).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

CHECKPOINT_SCRATCH_PREFIX = "flyroll-ckpt-"


def scratch_checkpoint_dir(iteration: int, parent: str | None = None) -> str:
    """A new temp folder for `train`'s checkpoint, named for this process and the iteration
    (`flyroll-ckpt-p<pid>-i<iteration>-...`); `publish_weights` removes it once the store holds the
    version. First removes the folders of processes that are gone (`reap_orphan_checkpoints`)."""
    parent = parent or tempfile.gettempdir()
    reap_orphan_checkpoints(parent)
    return tempfile.mkdtemp(prefix=f"{CHECKPOINT_SCRATCH_PREFIX}p{os.getpid()}-i{iteration:04d}-", dir=parent)


def reap_orphan_checkpoints(parent: str) -> list[str]:
    """Remove the scratch checkpoints under `parent` whose writing process no longer exists.

    A run killed between `train` and `publish_weights` (SIGKILL, OOM, a pod restart) never reaches
    the discard: on a local box each such kill left a whole checkpoint in the temp folder (1.6 GB for
    SmolLM2 with its optimizer state). The resumed run trains that iteration again into a new folder,
    so a dead process's folder holds nothing the store needs. Folders of a live process, and ones not
    named by `scratch_checkpoint_dir`, are left alone. Returns the folders removed."""
    removed = []
    for name in sorted(os.listdir(parent)):
        m = re.fullmatch(rf"{re.escape(CHECKPOINT_SCRATCH_PREFIX)}p(\d+)-i\d+-.*", name)
        path = os.path.join(parent, name)
        if m and os.path.isdir(path) and not os.path.exists(f"/proc/{m.group(1)}"):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def discard_scratch_checkpoint(path: str) -> None:
    """Delete `train`'s local scratch copy once the store holds the published one.

    A local Flyte run hands the FlyteDirectory over by path (no copy), so without this every
    iteration would leave its checkpoint behind in the temp folder (1.6 GB for SmolLM2 with its
    optimizer state). Only folders `train` made are touched; a remote run's path is an object-store
    URI and the pod's download dies with the pod."""
    name = os.path.basename(os.path.normpath(path))
    if os.path.isdir(path) and name.startswith(CHECKPOINT_SCRATCH_PREFIX) and \
            os.path.dirname(os.path.normpath(path)) == os.path.normpath(tempfile.gettempdir()):
        shutil.rmtree(path, ignore_errors=True)
