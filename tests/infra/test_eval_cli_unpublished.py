"""`flyroll eval --model <folder>` on a folder flyroll made that has no MANIFEST.json -- a version of a
local store whose publish did not finish, or whose manifest was removed; a copy in a run's fetch
cache -- is refused, naming the folder and why, unless --unverified, which evaluates it with a
warning printed and recorded in the output (issue 60). Before, such folders were evaluated without a
word. A Hugging Face folder of the user's own still evaluates without a flag, its output saying its
files were not checked."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from infra.eval_cli import main
from infra.store import ArtifactStore

torch.set_num_threads(1)

EVAL = ["--data", "synthetic:eval", "--limit", "2", "--max-new-tokens", "2"]


def run(capsys, argv: list[str]) -> tuple[int, dict | None, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else None), err


def _copy_model(tiny_model_dir: str, folder) -> str:
    shutil.copytree(tiny_model_dir, folder)
    return str(folder)


def test_a_version_whose_manifest_is_gone_is_refused_unless_unverified(tiny_model_dir, tmp_path, capsys):
    """v0002's MANIFEST.json removed -- as a crash before the publish's last step leaves it, or as the
    recovery hint says to do with a corrupt version."""
    store = ArtifactStore(str(tmp_path / "store"))
    for v in (1, 2):
        store.publish(tiny_model_dir, f"runs/r1/policy/v{v:04d}", kind="checkpoint", producer="test")
    folder = tmp_path / "store" / "runs/r1/policy/v0002"
    os.remove(folder / "MANIFEST.json")
    rc, _, err = run(capsys, ["--model", str(folder), *EVAL])
    assert rc == 2, err
    assert f"--model '{folder}': the folder has no MANIFEST.json" in err
    assert f"published ({tmp_path / 'store' / 'runs/r1/policy/v0001'})" in err
    assert "may be half-written, or was never published by flyroll" in err and "--unverified" in err

    rc, res, err = run(capsys, ["--model", str(folder), "--unverified", *EVAL])
    assert rc == 0, err
    assert "flyroll eval: warning: --unverified:" in err and str(folder) in err
    assert res["verified"] is False and res["unverified"].startswith(f"--unverified: {folder} has no MANIFEST.json")
    rc, res, err = run(capsys, ["--model", str(tmp_path / "store" / "runs/r1/policy/v0001"), *EVAL])
    assert rc == 0 and res["verified"] is True and "unverified" not in res, err


def test_a_publish_under_way_or_interrupted_is_refused(tiny_model_dir, tmp_path, capsys):
    """The files of a publish, its lease (.publishing/) and no manifest: what a publish SIGKILLed
    between its upload and its manifest leaves."""
    folder = _copy_model(tiny_model_dir, tmp_path / "store" / "models" / "tiny-x" / "v0000")
    os.makedirs(os.path.join(folder, ".publishing"))
    with open(os.path.join(folder, ".publishing", "0000000000"), "w") as f:
        f.write("{}")
    rc, _, err = run(capsys, ["--model", folder, *EVAL])
    assert rc == 2 and "holds .publishing/, the lease of a publish into an artifact store" in err, err


def test_the_first_version_of_a_run_in_a_store_is_refused_without_its_manifest(tiny_model_dir, tmp_path, capsys):
    store = ArtifactStore(str(tmp_path / "store"))
    store.lock_run("r1")
    store.unlock_run("r1")
    folder = _copy_model(tiny_model_dir, tmp_path / "store" / "runs" / "r1" / "policy" / "v0001")
    rc, _, err = run(capsys, ["--model", folder, *EVAL])
    assert rc == 2 and f"it lies inside the artifact store {tmp_path / 'store'}" in err, err


def test_a_fetch_cache_copy_is_refused(tiny_model_dir, tmp_path, capsys):
    store = ArtifactStore(str(tmp_path / "store"))
    store.publish(tiny_model_dir, "runs/r1/policy/v0001", kind="checkpoint", producer="test")
    copy = store.fetch("runs/r1/policy/v0001", str(tmp_path / "cache" / "r1" / "runs/r1/policy/v0001"), stamp=True)
    rc, _, err = run(capsys, ["--model", copy, *EVAL])
    assert rc == 2 and "it is a copy flyroll fetched from an artifact store" in err, err


@pytest.mark.parametrize("where", ["plain", "models"])
def test_a_hugging_face_folder_of_ones_own_is_evaluated_only_when_said_unverified(tiny_model_dir, tmp_path, capsys, where):
    """Nothing in a plain folder says which version it is (a version copied out of a store without its manifest
    looks the same), so it is refused like an unpublished one unless --unverified; also under a folder named
    models/ beside other models: no store there."""
    folder = tiny_model_dir if where == "plain" else _copy_model(tiny_model_dir, tmp_path / "models" / "mine")
    if where == "models":
        _copy_model(tiny_model_dir, tmp_path / "models" / "other")
    rc, res, err = run(capsys, ["--model", folder, *EVAL])
    assert rc == 2 and res is None
    assert f"--model {folder!r}: the folder has no MANIFEST.json, and nothing says which version it is" in err
    assert "--unverified" in err
    rc, res, err = run(capsys, ["--model", folder, "--unverified", *EVAL])
    assert rc == 0, err
    assert "warning" in err and res["verified"] is False
    assert res["unverified"].startswith(f"--unverified: {folder} has no MANIFEST.json, and nothing says which version it is")
