"""`model.reference_path`: the KL reference is that model, not the starting policy.

Two tiny policies saved as Hugging Face directories (same char tokenizer, different weights): with
`model.path` = the first and `model.reference_path` = the second, the real stage tasks (prepare,
rollout, scoring, reference forward; local Flyte execution, a local Ray instance) put the second
model's log-probs into `ref_logprobs`, and the store and MLflow name it. A missing reference, or
one with another vocabulary, is refused before the loop, naming the field and both models.
"""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import TINY
from tests.support.workflow import REPO


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> str:
    """A second tiny policy: the same tokenizer as `tiny_model_dir`, other weights (seed 1)."""
    from engines.models.modeling import build_tiny_policy, save_policy

    model, tok = build_tiny_policy(**TINY, seed=1)
    return save_policy(model, tok, str(tmp_path_factory.mktemp("reference")))


def _config(tmp_path, **model) -> str:
    cfg = yaml.safe_load((REPO / "tests/configs/e2e.yaml").read_text())
    cfg["run"]["output_dir"] = str(tmp_path / "runs")
    cfg["model"] = model
    cfg["rollout"].update(prompts_per_iteration=2, samples_per_prompt=2, max_new_tokens=4)
    cfg["algorithm"] = {"kl_coef": 0.1}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _logprobs(model_dir: str, df) -> list[list[float]]:
    from engines.models.batching import batched_logprobs, collate
    from engines.models.modeling import load_policy

    model, tok = load_policy(model_dir)
    responses = [list(r) for r in df["response_token_ids"]]
    batch = collate([list(p) for p in df["prompt_token_ids"]], responses, tok.pad_token_id)
    lp = batched_logprobs(model.eval(), batch, micro_batch=64)
    return [lp[i, : len(r)].tolist() for i, r in enumerate(responses)]


@pytest.mark.slow  # a real pyflyte run (~50-90 s): kept out of the default tier
def test_reference_path_is_the_kl_reference(tmp_path, monkeypatch, tiny_model_dir, reference_dir):
    import numpy as np

    from infra import tracking
    from infra.ray_session import shutdown
    from infra.store import ArtifactStore
    from tasks.stages.prepare import build_base_policy, make_dataset, prepare_run, reference_policy
    from tasks.stages.reference import reference_forward
    from tasks.stages.rollout import rollout
    from tasks.stages.scoring import score

    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))
    spec, model_spec = prepare_run(config=_config(tmp_path, path=tiny_model_dir, reference_path=reference_dir), restart=False)
    base = build_base_policy(model_spec)
    ref = reference_policy(spec=spec, model_spec=model_spec, base=base)
    assert ref.key != base.key
    try:
        dataset = make_dataset(spec=spec, base=base)
        batch = rollout(spec=spec, policy=base, dataset=dataset, iteration=1)
        scored = score(spec=spec, batch=batch, iteration=1)
        full = reference_forward(spec=spec, batch=scored, policy=base, reference=ref, iteration=1)
    finally:
        shutdown()
    want, policy_lp = _logprobs(reference_dir, full), _logprobs(tiny_model_dir, full)
    for got, exp, pol in zip(full["ref_logprobs"], want, policy_lp):
        np.testing.assert_allclose(list(got), exp, atol=1e-5)           # the reference model's log-probs ...
        assert not np.allclose(list(got), pol, atol=1e-3)               # ... not the policy's
    store = ArtifactStore(spec.store_uri)
    assert store.manifest(ref.key).metadata["imported_from"] == reference_dir
    table = store.manifest(f"runs/{spec.run_id}/rollouts/i0001")
    assert table.parents == [base.key, ref.key] and table.metadata["reference"] == ref.key
    assert tracking.client(spec.tracking_uri).get_run(spec.mlflow_run_id).data.tags["flyroll.reference"] == ref.key


def test_missing_reference_path_names_the_field_and_the_path(tmp_path, tiny_model_dir):
    from tasks.stages.prepare import prepare_run

    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match=rf"model.reference_path '{missing}': no such local directory"):
        prepare_run(config=_config(tmp_path, path=tiny_model_dir, reference_path=missing), restart=False)
    assert not (tmp_path / "runs" / "mlflow.db").exists()  # refused before the MLflow run was opened


def test_reference_with_another_vocabulary_is_refused(tmp_path, tiny_model_dir):
    from engines.models.modeling import CHARSET, build_char_tokenizer, build_tiny_policy, save_policy
    from tasks.stages.prepare import build_base_policy, prepare_run, reference_policy

    model, _ = build_tiny_policy(**TINY, seed=2)
    other = save_policy(model, build_char_tokenizer(CHARSET[::-1]), str(tmp_path / "reversed"))  # same size, other ids
    spec, model_spec = prepare_run(config=_config(tmp_path, path=tiny_model_dir, reference_path=other), restart=False)
    base = build_base_policy(model_spec)
    with pytest.raises(ValueError, match="another vocabulary") as err:
        reference_policy(spec=spec, model_spec=model_spec, base=base)
    assert repr(other) in str(err.value) and repr(tiny_model_dir) in str(err.value) and base.key in str(err.value)
