"""`engines/models/batching.py` on a tiny char-level Qwen2 (seconds on one CPU thread): the batch layout
(`collate`), per-token log-probs that ignore padding, and the fused log-probs + entropy against
log_softmax (moved out of the training engine's tests, tests/engines/training/test_update.py)."""

from __future__ import annotations

import pytest
import torch

from engines.models.batching import collate, response_logprobs, token_logprobs_and_entropy
from tests.support.engines import PROMPTS, encode

torch.set_num_threads(1)


def test_collate_layout():
    b = collate([[11, 12, 13], [14]], [[15, 16], [17, 18, 19]], pad_id=0, loss_masks=[[1, 0], [0, 1, 1]])
    # P = 3 (prompts left-padded), T = 3 (responses right-padded)
    assert b.prompt_width == 3
    assert b.input_ids.tolist() == [[11, 12, 13, 15, 16, 0], [0, 0, 14, 17, 18, 19]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    # positions count real tokens from 0; pads get 0 (left) or repeat the last position (right)
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b.responses.tolist() == [[15, 16, 0], [17, 18, 19]]
    assert b.response_mask.tolist() == [[1, 0, 0], [0, 1, 1]]  # loss masks, zero on padding
    sub = b.select([1])
    assert sub.input_ids.tolist() == [[0, 0, 14, 17, 18, 19]] and sub.prompt_width == 3


def test_collate_default_mask_and_empty_response():
    b = collate([[11, 12], [13]], [[14, 15], []], pad_id=0)
    assert b.response_mask.tolist() == [[1, 1], [0, 0]]
    empty = collate([[11]], [[]], pad_id=0)
    assert empty.responses.shape == (1, 1) and empty.response_mask.tolist() == [[0.0]]


def test_response_logprobs_ignore_padding(tiny_policy):
    """Each row's log-probs in a padded batch equal those of the row alone, unpadded."""
    model, tok = tiny_policy
    prompts = encode(tok, PROMPTS)
    responses = encode(tok, ["3", "cba\n", "9-3"])
    batch = collate(prompts, responses, tok.pad_token_id)
    with torch.no_grad():
        logp, ent = response_logprobs(model, batch, with_entropy=True)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1]
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
            torch.testing.assert_close(logp[i, : len(r)], want, atol=1e-5, rtol=0)
    assert ((ent >= 0) & (ent <= torch.log(torch.tensor(float(len(tok)))) + 1e-5)).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use", ["logp", "entropy", "both"])
def test_fused_logprobs_and_entropy_match_log_softmax(use, temperature, monkeypatch):
    """Values and gradients of token_logprobs_and_entropy equal log_softmax + gather and
    -(p log p).sum of logits / temperature (float64), whichever outputs the loss uses, computed in
    several chunks of positions, with and without overwriting the logits; torch's gradcheck agrees."""
    import engines.models.batching as batching

    monkeypatch.setattr(batching, "_CHUNK_ELEMENTS", 5 * 50)  # 5 positions a pass: 24 rows -> 5 chunks
    torch.manual_seed(0)
    leaf = (3 * torch.randn(4, 6, 50, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 50, (4, 6))
    w_lp, w_h = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)

    def loss(lp, h):
        return {"logp": (w_lp * lp).sum(), "entropy": (w_h * h).sum(), "both": (w_lp * lp).sum() + (w_h * h).sum()}[use]

    ls = torch.log_softmax(leaf / temperature, -1)
    ref_lp, ref_h = ls.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(ls.exp() * ls).sum(-1)
    (ref_grad,) = torch.autograd.grad(loss(ref_lp, ref_h), leaf)
    for overwrite in (False, True):
        logits = leaf * 1.0  # an intermediate, as a model's output is
        before = logits.detach().clone()
        lp, h = token_logprobs_and_entropy(logits, targets, temperature, overwrite=overwrite)
        assert torch.equal(logits.detach(), before) != overwrite  # overwritten only when handed over
        (grad,) = torch.autograd.grad(loss(lp, h), leaf)
        torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)
        torch.testing.assert_close(h, ref_h, atol=1e-12, rtol=0)
        torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)
    lp, _ = token_logprobs_and_entropy(leaf * 1.0, targets, temperature, with_entropy=False, overwrite=True)
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)
    small = leaf[:2, :3, :7].detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: token_logprobs_and_entropy(z, targets[:2, :3] % 7, temperature), (small,))


def test_overwriting_logprobs_refuse_a_second_backward():
    """With overwrite the gradient is written over the saved log-softmax, so a second backward
    through the same graph would be wrong: it raises instead."""
    leaf = torch.randn(2, 3, 11, requires_grad=True)
    lp, h = token_logprobs_and_entropy(leaf * 1.0, torch.zeros(2, 3, dtype=torch.long), overwrite=True)
    total = lp.sum() + h.sum()
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        total.backward()
