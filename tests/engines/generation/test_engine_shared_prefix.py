"""Shared prefixes. Log-probs (engines/models/batching.py): each distinct prompt runs once and its KV cache
is indexed out to the rows that repeat it; the log-probs, their gradients and a whole training
update must equal the plain every-row computation. Generation (engines/generation/engine.py): each prompt
is prefilled once for its n samples; the samples must be the ones transformers' own n-fold prefill
gives. Both architectures the project trains: Qwen2 (the tiny default) and Llama (SmolLM2's)."""

from __future__ import annotations

import copy

import pytest
import torch

from engines.models.batching import collate, prompt_groups, response_logits, response_logprobs


def _llama(vocab: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(params=["qwen2", "llama"])
def model(request, tiny_policy):
    return copy.deepcopy(tiny_policy[0]) if request.param == "qwen2" else _llama(len(tiny_policy[1]))


def _grpo_batch(vocab: int, seed: int = 0):
    """3 prompts of different lengths x 3 samples + 1 prompt seen once; responses of varied length
    (one empty-ish: a single token), rows interleaved so groups are not adjacent."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    rows = [(0, 4), (1, 6), (2, 1), (0, 8), (1, 3), (2, 5), (0, 2), (1, 7), (2, 6), (3, 5)]
    prompt_ids = [prompts[p] for p, _ in rows]
    response_ids = [torch.randint(3, vocab, (n,), generator=g).tolist() for _, n in rows]
    return collate(prompt_ids, response_ids, pad_id=0)


def test_groups_follow_the_prompt_tokens(tiny_policy):
    batch = _grpo_batch(tiny_policy[0].config.vocab_size)
    groups = prompt_groups(batch).tolist()
    assert len(set(groups)) == 4
    assert groups[0] == groups[3] == groups[6] and groups[1] == groups[4] == groups[7] and groups[2] == groups[5] == groups[8]
    assert groups[9] not in groups[:9]


def test_logits_and_logprobs_match_the_plain_forward(model):
    batch = _grpo_batch(model.config.vocab_size)
    P, T = batch.prompt_width, batch.responses.shape[1]
    with torch.no_grad():
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
        shared = response_logits(model, batch, shared_prefix=True)
        plain = response_logits(model, batch, shared_prefix=False)
    reference = full[:, P - 1 : P + T - 1]
    mask = batch.response_mask.bool()
    assert shared.shape == plain.shape == reference.shape
    assert torch.allclose(plain[mask], reference[mask], atol=1e-5)
    assert torch.allclose(shared[mask], reference[mask], atol=1e-5), (shared[mask] - reference[mask]).abs().max()
    a, _ = response_logprobs(model, batch, shared_prefix=True)
    b, _ = response_logprobs(model, batch, shared_prefix=False)
    assert torch.allclose(a * batch.response_mask, b * batch.response_mask, atol=1e-5)


def test_gradients_match_the_plain_forward(model):
    batch = _grpo_batch(model.config.vocab_size, seed=1)
    grads = []
    for shared in (True, False):
        model.zero_grad()
        logp, entropy = response_logprobs(model, batch, with_entropy=True, shared_prefix=shared)
        ((logp + 0.1 * entropy) * batch.response_mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-4), n


def test_a_one_token_prompt_among_longer_ones(model):
    """Its prefix (the prompt without its last token) is all padding: the shared prefill must still
    leave finite values that the rows' forward masks out (a NaN there would spread to every row)."""
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 6)]
    rows = [0, 1, 0, 1, 0, 1]
    batch = collate([prompts[r] for r in rows], [torch.randint(3, vocab, (4,), generator=g).tolist() for _ in rows], pad_id=0)
    grads = []
    for shared in (True, False):
        model.zero_grad()
        logp, _ = response_logprobs(model, batch, shared_prefix=shared)
        assert torch.isfinite(logp).all()
        (logp * batch.response_mask).sum().backward()
        grads.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-5)
    for n, g_shared in grads[0][1].items():
        assert torch.allclose(g_shared, grads[1][1][n], atol=1e-5, rtol=1e-4), n


def test_training_update_equals_the_every_row_update(tiny_policy):
    """One GRPO-style update with shared prefixes (the default on the torch strategy) lands on the
    same parameters as with every row's prompt run (micro-batches of a few rows, so groups also
    straddle micro-batch boundaries)."""
    from engines.algorithms.config import AlgorithmConfig
    from engines.training.strategies import TorchStrategy
    from engines.training.update import TorchTrainEngine

    class EveryRow(TorchStrategy):
        shared_prefix = False

    batch = _grpo_batch(tiny_policy[0].config.vocab_size, seed=2)
    B, T = batch.responses.shape
    adv = torch.randn(B, 1).expand(B, T).contiguous()
    cfg = AlgorithmConfig(advantage="grpo", kl_coef=0.0)
    params = []
    for strategy in (TorchStrategy(), EveryRow()):
        model = copy.deepcopy(tiny_policy[0])
        with torch.no_grad():
            old, _ = response_logprobs(model, batch)
        engine = TorchTrainEngine(model, lr=1e-2, strategy=strategy)
        metrics = engine.train_step(batch, adv, old * batch.response_mask, None, cfg, mini_batch_size=B,
                                    max_tokens_per_micro_batch=60, seed=3)
        assert metrics["actor/updates"] == 1.0
        params.append([p.detach().clone() for p in model.parameters()])
    moved = [not torch.equal(a, b) for a, b in zip(params[0], [p for p in tiny_policy[0].parameters()])]
    assert sum(moved) >= len(moved) // 2
    for a, b in zip(*params):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_with_one_prefill_per_prompt_gives_the_same_samples(model, tiny_policy, temperature):
    """Greedy: the same tokens. Sampling with a seed: the same draws (the same logits feed the same
    RNG calls), so the same tokens too; behaviour log-probs agree to float precision."""
    from engines.generation.engine import HFGenerationEngine, SamplingParams

    tok = tiny_policy[1]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ["1+2=", "rev abcdef=", "9-3+4-1=", "7"]]
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=12, seed=5)
    shapes = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    shared = HFGenerationEngine(model, tok, micro_batch=3).generate(prompts, params)
    prefill_shapes, shapes[:] = list(shapes), []
    every = HFGenerationEngine(model, tok, micro_batch=3, shared_prefill=False).generate(prompts, params)
    # shared: one prefill of the 3 prompts (width 11 - 1), then generate only decodes 9 rows a token at a time
    assert prefill_shapes[0] == (3, 10) and all(s[1] == 1 for s in prefill_shapes[1:] if s[0] == 9)
    assert (9, 10) not in prefill_shapes and (9, 11) not in prefill_shapes
    assert shapes[0] == (9, 11)  # transformers' own path prefills every sample
    assert [(c.prompt_index, c.sample_index) for c in shared] == [(c.prompt_index, c.sample_index) for c in every]
    assert len(shared) == 12 and len({tuple(c.token_ids) for c in shared}) > (1 if temperature else 0)
    for a, b in zip(shared, every):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)  # float summation order only


def test_compiled_decode_rounds_the_static_cache_up_and_keeps_the_samples(model, tiny_policy, monkeypatch):
    """`compile_decode` rounds the group's static KV cache up to CACHE_BUCKET tokens (so prompt
    widths share a compiled graph on GPUs; on CPU transformers compiles nothing): the extra slots
    are masked, so the samples and log-probs equal the exact-length cache's."""
    from transformers import StaticCache

    from engines.generation.engine import CACHE_BUCKET, HFGenerationEngine, SamplingParams

    tok = tiny_policy[1]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ["1+2=", "rev abcdef=", "9-3+4-1="]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=7)
    lengths = []
    real_init = StaticCache.__init__

    def spy(self, *args, **kwargs):
        lengths.append(kwargs["max_cache_len"])
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(StaticCache, "__init__", spy)
    compiled = HFGenerationEngine(model, tok, compile_decode=True).generate(prompts, params)
    exact = HFGenerationEngine(model, tok).generate(prompts, params)
    width = max(map(len, prompts))
    assert lengths == [CACHE_BUCKET, width + 10]
    assert [c.token_ids for c in compiled] == [c.token_ids for c in exact]
    for a, b in zip(compiled, exact):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.parametrize("shared", [True, False])
def test_native_gqa_attention_gives_the_same_logprobs_and_gradients(model, shared, monkeypatch):
    """engines/models/batching.py native_gqa: on CPU the log-prob forwards run transformers' SDPA with
    `enable_gqa` and give the log-probs and gradients of the key/value head copy it replaces
    (what runs where the user set TRANSFORMERS_SDPA_FORCE_GQA=0), on left-padded rows (a mask) with
    and without the shared prefix; the variable is unset again afterwards."""
    import os

    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    batch = _grpo_batch(model.config.vocab_size, seed=2)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    runs = {}
    for user in ("0", None):
        if user is None:
            monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
        else:
            monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", user)
        calls.clear()
        model.zero_grad()
        logp, entropy = response_logprobs(model, batch, with_entropy=True, shared_prefix=shared)
        ((logp + 0.1 * entropy) * batch.response_mask).sum().backward()
        runs[user] = (logp * batch.response_mask, {n: p.grad.clone() for n, p in model.named_parameters()})
        assert calls and set(calls) == {user is None}  # the path under test ran in every layer
        assert os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA") == user
    torch.testing.assert_close(runs[None][0], runs["0"][0], atol=1e-5, rtol=0)
    for name, grad in runs["0"][1].items():
        torch.testing.assert_close(runs[None][1][name], grad, atol=1e-5, rtol=0, msg=name)
