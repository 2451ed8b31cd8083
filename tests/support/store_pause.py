"""A test hook that pauses a run inside the artifact store so a test can SIGKILL it there
(tests/infra/test_tracking_run_status.py, tests/tasks/loop/test_publish_plan.py): a `sitecustomize.py` put first on the run's
PYTHONPATH wraps `infra.store.ArtifactStore` when that module is imported, in every process of the run.

- `FLYROLL_TEST_PAUSE_PUBLISH=<suffix>`: right after the store published a key ending in it (the
  version is complete: its manifest is written).
- `FLYROLL_TEST_PAUSE_MANIFEST=<suffix>`: in the publish of a key ending in it, after its files are
  uploaded and before its manifest is written (a partial version: files, no manifest).

The first process to get there creates `$FLYROLL_TEST_PAUSED` and sleeps (the test kills the run
meanwhile); later ones go on. Nothing is wrapped when neither variable is set."""

from __future__ import annotations

from pathlib import Path

SITECUSTOMIZE = '''
"""Test hook (tests/support/store_pause.py): pause in the artifact store so the test can SIGKILL the run there."""
import importlib.abc, importlib.machinery, os, sys, time

def _pause():
    try:
        os.close(os.open(os.environ["FLYROLL_TEST_PAUSED"], os.O_CREAT | os.O_EXCL))
        time.sleep(300)
    except FileExistsError:
        pass

class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "infra.store":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            publish, retry = module.ArtifactStore.publish, module.ArtifactStore._retry
            after, before_manifest = os.environ.get("FLYROLL_TEST_PAUSE_PUBLISH"), os.environ.get("FLYROLL_TEST_PAUSE_MANIFEST")

            def paused(self, local_dir, key, **kw):
                out = publish(self, local_dir, key, **kw)
                if after and key.endswith(after):
                    _pause()
                return out

            def manifest_paused(self, what, fn, *args, **kw):
                # the publish's manifest write: every file of the version is uploaded, its manifest is not
                if before_manifest and what.startswith("write ") and what.endswith(before_manifest + "/" + module.MANIFEST_NAME):
                    _pause()
                return retry(self, what, fn, *args, **kw)

            module.ArtifactStore.publish = paused
            module.ArtifactStore._retry = manifest_paused

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("FLYROLL_TEST_PAUSE_PUBLISH") or os.environ.get("FLYROLL_TEST_PAUSE_MANIFEST"):
    sys.meta_path.insert(0, _Hook())
'''


def store_pause_hook(folder: Path) -> Path:
    """Write the hook as `folder/sitecustomize.py`; put `folder` first on the run's PYTHONPATH."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return folder
