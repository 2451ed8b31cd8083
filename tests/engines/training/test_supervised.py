"""SFT and preference updates on the trainer's engine (engines/training/supervised.py), on the tiny
char-level policy: the SFT loss is the masked token mean and falls; the step does not depend on the
micro-batch size; preference pairs stay paired and the DPO step equals one computed by hand with the
loss functions on full-batch log-probs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from engines.algorithms.preference import get_preference_loss
from engines.models.batching import response_logits, response_logprobs
from engines.training.supervised import (batch_of, encode_demonstration, encode_pair, pair_batch, preference_update,
                                         reference_sequence_logps, sft_update, token_nll)
from engines.training.update import TorchTrainEngine
from tests.support.engines import params_of

torch.set_num_threads(1)

DEMOS = [("1+2=", "3"), ("rev abc=", "cba"), ("9-3=", "6"), ("rev xy=", "yx"), ("4+4=", "8"), ("2+7=", "9")]
PAIRS = [("1+2=", "3", "4"), ("rev abc=", "cba", "abc"), ("9-3=", "6", "5"), ("4+4=", "8", "44")]


def sgd(model, lr=0.5):
    engine = TorchTrainEngine(model)
    engine.optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)
    return engine


def test_encode_demonstration_masks_the_response_and_appends_eos(tiny_policy):
    _, tok = tiny_policy
    e = encode_demonstration(tok, "1+2=", None, "3", chat=False)
    assert e.prompt_ids == tok("1+2=", add_special_tokens=False)["input_ids"]
    assert e.response_ids[-1] == tok.eos_token_id and e.loss_mask == [1] * len(e.response_ids)
    whole = encode_demonstration(tok, "1+2=", None, "3", chat=False, prompt_loss=True)
    assert whole.prompt_ids + whole.response_ids == e.prompt_ids + e.response_ids
    assert len(whole.prompt_ids) == 1 and sum(whole.loss_mask) == e.length - 1


def test_conversation_without_a_chat_template_is_refused(tiny_policy):
    _, tok = tiny_policy
    with pytest.raises(ValueError, match="needs a chat template"):
        encode_demonstration(tok, "q", [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "a",
                             chat=False)


def test_sft_loss_is_the_masked_token_mean_and_falls(tiny_policy):
    model, tok = copy.deepcopy(tiny_policy[0]), tiny_policy[1]
    batch = batch_of([encode_demonstration(tok, p, None, r, chat=False) for p, r in DEMOS], tok.pad_token_id)
    nll, n = token_nll(model, batch, 4096)
    with torch.no_grad():
        logp, _ = response_logprobs(model, batch, shared_prefix=False)
    assert n == float(batch.response_mask.sum())
    assert nll / n == pytest.approx(float(-(logp * batch.response_mask).sum() / batch.response_mask.sum()), rel=1e-5)
    engine = TorchTrainEngine(model, lr=3e-3)
    first = sft_update(engine, batch, mini_batch_size=len(DEMOS), max_tokens_per_micro_batch=4096)
    assert first["sft/loss"] == pytest.approx(nll / n, rel=1e-4)   # the step's loss is the batch's token mean
    for s in range(30):
        last = sft_update(engine, batch, mini_batch_size=len(DEMOS), max_tokens_per_micro_batch=4096, seed=s)
    assert last["sft/loss"] < 0.5 * first["sft/loss"]


def test_sft_step_does_not_depend_on_the_micro_batch_size(tiny_policy):
    tok = tiny_policy[1]
    batch = batch_of([encode_demonstration(tok, p, None, r, chat=False) for p, r in DEMOS], tok.pad_token_id)
    out = []
    for cap in (4096, 16):   # one micro-batch, then one or two rows each
        model = copy.deepcopy(tiny_policy[0])
        m = sft_update(sgd(model), batch, mini_batch_size=len(DEMOS), max_tokens_per_micro_batch=cap)
        out.append((params_of(model), m["sft/loss"]))
    (a, la), (b, lb) = out
    assert la == pytest.approx(lb, rel=1e-5)
    assert max(float((a[k] - params_of(tiny_policy[0])[k]).abs().max()) for k in a) > 1e-4
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("loss,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_preference_step_equals_the_loss_on_whole_pairs(tiny_policy, loss, smoothing):
    """One step over all pairs, micro-batches of about one pair, equals SGD on the loss computed by
    hand from full-batch log-probs (so the pairs stayed paired in every micro-batch)."""
    tok = tiny_policy[1]
    pairs = [encode_pair(tok, p, None, c, r, chat=False) for p, c, r in PAIRS]
    batch = pair_batch(pairs, tok.pad_token_id)
    reference = copy.deepcopy(tiny_policy[0])
    with torch.no_grad():   # a reference that differs from the policy
        for p in reference.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    ref_sum, ref_mean = (torch.tensor(x) for x in reference_sequence_logps(reference, batch, 4096))
    beta = 0.5

    expected = copy.deepcopy(tiny_policy[0])
    opt = torch.optim.SGD(expected.parameters(), lr=0.5)
    logp, _ = response_logprobs(expected, batch, shared_prefix=False)
    summed = (logp * batch.response_mask).sum(-1)
    pol = summed if loss != "ipo" else summed / batch.response_mask.sum(-1)
    ref = ref_sum if loss != "ipo" else ref_mean
    losses, _ = get_preference_loss(loss)(pol[0::2], pol[1::2], ref[0::2], ref[1::2], beta=beta, label_smoothing=smoothing)
    losses.mean().backward()
    torch.nn.utils.clip_grad_norm_(expected.parameters(), 1.0)
    opt.step()

    model = copy.deepcopy(tiny_policy[0])
    m = preference_update(sgd(model), batch, ref_sum, ref_mean, loss=loss, beta=beta, label_smoothing=smoothing,
                          mini_batch_size=len(PAIRS), max_tokens_per_micro_batch=2 * batch.input_ids.shape[1])
    assert m["dpo/loss"] == pytest.approx(float(losses.mean().detach()), rel=1e-4)
    assert m["dpo/updates"] == 1.0
    want = params_of(expected)
    for k, v in params_of(model).items():
        torch.testing.assert_close(v, want[k], atol=2e-6, rtol=1e-4)


def test_preference_metrics_follow_trl(tiny_policy):
    tok = tiny_policy[1]
    batch = pair_batch([encode_pair(tok, p, None, c, r, chat=False) for p, c, r in PAIRS], tok.pad_token_id)
    model = copy.deepcopy(tiny_policy[0])
    ref_sum, ref_mean = (torch.tensor(x) for x in reference_sequence_logps(model, batch, 4096))
    m = preference_update(sgd(model, lr=1e-9), batch, ref_sum, ref_mean, loss="sigmoid", beta=0.1,
                          mini_batch_size=len(PAIRS), max_tokens_per_micro_batch=4096)
    # the policy is the reference at the first step: every implicit reward is 0, the loss log 2
    assert m["rewards/chosen"] == pytest.approx(0.0, abs=1e-5) and m["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert m["dpo/loss"] == pytest.approx(float(-F.logsigmoid(torch.tensor(0.0))), rel=1e-5)
    assert m["logps/chosen"] == pytest.approx(float(ref_sum[0::2].mean()), rel=1e-5)
    assert m["rewards/accuracies"] == 0.0


def test_teacher_topk_are_the_teachers_most_likely_tokens(tiny_policy):
    from engines.training.supervised import teacher_topk

    model, tok = tiny_policy
    batch = batch_of([encode_demonstration(tok, p, None, r, chat=False) for p, r in DEMOS], tok.pad_token_id)
    rows = teacher_topk(model, batch, 5, 64)   # small chunks: rows of several micro-batches
    with torch.no_grad():
        logp = torch.log_softmax(response_logits(model, batch, shared_prefix=False).float(), -1)
    for i, (ids, lps) in enumerate(rows):
        n = int(batch.response_mask[i].sum())
        assert len(ids) == n and all(len(x) == 5 for x in ids)
        want_v, want_i = logp[i, :n].topk(5, -1)
        assert ids == want_i.tolist()
        torch.testing.assert_close(torch.tensor(lps), want_v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("divergence,weight,options", [("forward_kl", 0.5, {}), ("reverse_kl", 1.0, {}),
                                                       ("jsd", 0.3, {"beta": 0.2})])
def test_distill_step_equals_the_loss_on_the_whole_batch(tiny_policy, divergence, weight, options):
    """One step, micro-batches of about one row, equals SGD on w·D + (1 − w)·S computed by hand on the
    full batch against a teacher's top-k (engines/algorithms/distill.py)."""
    from engines.algorithms.distill import distill_loss, sft_token_nll, topk_token_divergence
    from engines.training.supervised import distill_update, teacher_topk, topk_tensors

    tok = tiny_policy[1]
    batch = batch_of([encode_demonstration(tok, p, None, r, chat=False) for p, r in DEMOS], tok.pad_token_id)
    teacher = copy.deepcopy(tiny_policy[0])
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    ids, lps = topk_tensors(teacher_topk(teacher, batch, 6, 4096), batch.responses.shape[1], 6)
    kw = dict(divergence=divergence, student_temperature=1.5, teacher_temperature=0.8)

    expected = copy.deepcopy(tiny_policy[0])
    opt = torch.optim.SGD(expected.parameters(), lr=0.5)
    logits = response_logits(expected, batch, shared_prefix=False).float()
    div = topk_token_divergence(logits, ids, lps, **kw, **options)
    loss, _ = distill_loss(div, batch.response_mask, token_nll=sft_token_nll(logits, batch.responses),
                           distill_loss_weight=weight)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(expected.parameters(), 1.0)
    opt.step()

    model = copy.deepcopy(tiny_policy[0])
    m = distill_update(sgd(model), batch, ids, lps, divergence_weight=weight, options=options, **kw,
                       mini_batch_size=len(DEMOS), max_tokens_per_micro_batch=16)
    assert m["distill/loss"] == pytest.approx(float(loss), rel=1e-4)
    want = params_of(expected)
    for k, v in params_of(model).items():
        torch.testing.assert_close(v, want[k], atol=2e-6, rtol=1e-4)
