"""Distillation divergences (forward/reverse KL, GKD's generalised JSD, DistiLLM's skewed KLs) on the
teacher's top-k and on the full vocabulary, and the loss mixed with SFT: each checked against the
formula written again here with numpy (float64) on hand-made and random inputs, against TRL's
``GKDTrainer.generalized_jsd_loss`` when TRL is importable, and for the properties (KL ≥ 0, zero on
equal distributions, JSD's symmetry, gradients, masking, top-k with k = V = full vocabulary)."""

import math

import numpy as np
import pytest
import torch

from engines.algorithms.distill import (
    DIVERGENCES,
    distill_loss,
    full_vocab_token_divergence,
    get_divergence,
    sft_token_nll,
    topk_token_divergence,
)

NAMES = ["forward_kl", "reverse_kl", "jsd", "skewed_forward_kl", "skewed_reverse_kl"]
OPTIONS = {"jsd": [{"beta": b} for b in (0.0, 0.1, 0.5, 0.9, 1.0)],
           "skewed_forward_kl": [{"skew": s} for s in (0.0, 0.1, 0.5, 1.0)],
           "skewed_reverse_kl": [{"skew": s} for s in (0.0, 0.1, 0.5, 1.0)]}
CASES = [(n, o) for n in NAMES for o in OPTIONS.get(n, [{}])]


# --- the formulas, again, in numpy ------------------------------------------------------------
def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _kl(p: np.ndarray, r: np.ndarray) -> np.ndarray:
    """KL(p ‖ r) over the last axis, 0·log 0 = 0."""
    safe = np.where(p > 0, p, 1.0)
    return np.where(p > 0, p * (np.log(safe) - np.log(r)), 0.0).sum(-1)


def _np_divergence(name: str, s: np.ndarray, q: np.ndarray, **opt) -> np.ndarray:
    """s: student probs, q: teacher probs, both normalised over the last axis."""
    if name == "forward_kl":
        return _kl(q, s)
    if name == "reverse_kl":
        return _kl(s, q)
    if name == "jsd":                 # GKD eq. 1 / TRL: m = β·q + (1 − β)·s; β = 0, 1 are the plain KLs
        b = opt["beta"]
        if b == 0:
            return _kl(q, s)
        if b == 1:
            return _kl(s, q)
        m = b * q + (1 - b) * s
        return b * _kl(q, m) + (1 - b) * _kl(s, m)
    if name == "skewed_forward_kl":   # DistiLLM skew KL: KL(q ‖ λq + (1 − λ)s)
        lam = opt["skew"]
        return _kl(q, lam * q + (1 - lam) * s)
    if name == "skewed_reverse_kl":   # DistiLLM skew reverse KL: KL(s ‖ (1 − λ)q + λs)
        lam = opt["skew"]
        return _kl(s, (1 - lam) * q + lam * s)
    raise AssertionError(name)


def _random(seed: int, B=2, T=3, V=11, k=4):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(B * T)]).view(B, T, k)
    return student, teacher, ids


# --- hand-worked values -----------------------------------------------------------------------
def test_hand_values_two_tokens():
    # teacher q = [1/2, 1/2], student s = [1/4, 3/4]
    student = torch.log(torch.tensor([[[0.25, 0.75]]], dtype=torch.float64))
    teacher = torch.log(torch.tensor([[[0.5, 0.5]]], dtype=torch.float64))
    f = full_vocab_token_divergence(student, teacher, divergence="forward_kl")
    r = full_vocab_token_divergence(student, teacher, divergence="reverse_kl")
    j = full_vocab_token_divergence(student, teacher, divergence="jsd", beta=0.5)
    # KL(q‖s) = ½ ln(0.5/0.25) + ½ ln(0.5/0.75) = ½ ln(4/3) = 0.143841
    assert f.item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)
    # KL(s‖q) = ¼ ln(1/2) + ¾ ln(3/2) = 0.130812
    assert r.item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-12)
    # m = [3/8, 5/8]: ½[½ ln(4/3) + ½ ln(4/5)] + ½[¼ ln(2/3) + ¾ ln(6/5)] = 0.033822
    expected = 0.5 * (0.5 * math.log(4 / 3) + 0.5 * math.log(4 / 5)) + 0.5 * (0.25 * math.log(2 / 3) + 0.75 * math.log(6 / 5))
    assert j.item() == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(0.033822, abs=1e-6)


def test_topk_renormalises_both_over_the_k():
    # V = 3, teacher top-2 ids [0, 1] with log-probs ln 0.6, ln 0.2 → renormalised q = [3/4, 1/4];
    # student probs [0.2, 0.2, 0.6] → over ids {0, 1}: s = [1/2, 1/2]; KL(q‖s) = ¾ ln(3/2) + ¼ ln(1/2)
    student = torch.log(torch.tensor([[[0.2, 0.2, 0.6]]], dtype=torch.float64))
    ids = torch.tensor([[[0, 1]]])
    teacher = torch.log(torch.tensor([[[0.6, 0.2]]], dtype=torch.float64))
    d = topk_token_divergence(student, ids, teacher, divergence="forward_kl")
    assert d.item() == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), abs=1e-12)


# --- against the formulas on random inputs ----------------------------------------------------
@pytest.mark.parametrize("name,opt", CASES)
@pytest.mark.parametrize("temps", [(1.0, 1.0), (2.0, 2.0), (0.7, 1.5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_full_vocab_matches_numpy(name, opt, temps, seed):
    student, teacher, _ = _random(seed)
    ts, tt = temps
    got = full_vocab_token_divergence(student, teacher, divergence=name, student_temperature=ts,
                                      teacher_temperature=tt, **opt)
    expected = _np_divergence(name, _softmax(student.numpy() / ts), _softmax(teacher.numpy() / tt), **opt)
    assert got.shape == student.shape[:2]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name,opt", CASES)
@pytest.mark.parametrize("temps", [(1.0, 1.0), (0.7, 1.5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_topk_matches_numpy(name, opt, temps, seed):
    """Teacher: softmax over the k of its log-probs / τ_t. Student: the full-vocabulary softmax at
    τ_s, gathered at the teacher's ids and divided by its mass there (the other way the module's
    docstring states the same thing)."""
    student, teacher, ids = _random(seed)
    ts, tt = temps
    teacher_logps = torch.log_softmax(teacher, -1).gather(-1, ids)             # what a server returns
    got = topk_token_divergence(student, ids, teacher_logps, divergence=name, student_temperature=ts,
                                teacher_temperature=tt, **opt)
    s_full = _softmax(student.numpy() / ts)
    s_k = np.take_along_axis(s_full, ids.numpy(), -1)
    s_k = s_k / s_k.sum(-1, keepdims=True)
    q_k = _softmax(teacher_logps.numpy() / tt)
    np.testing.assert_allclose(got.numpy(), _np_divergence(name, s_k, q_k, **opt), rtol=1e-9, atol=1e-12)


def test_jsd_half_matches_roll_js_divergence():
    # ROLL's compute_js_divergence: m = (s + q)/2, (KL(q‖m) + KL(s‖m))/2 (it adds 1e-9 inside the logs)
    student, teacher, _ = _random(3)
    s, q = _softmax(student.numpy()), _softmax(teacher.numpy())
    m = (s + q) / 2
    roll = ((q * (np.log(q + 1e-9) - np.log(m + 1e-9))) + (s * (np.log(s + 1e-9) - np.log(m + 1e-9)))).sum(-1) / 2
    got = full_vocab_token_divergence(student, teacher, divergence="jsd", beta=0.5)
    np.testing.assert_allclose(got.numpy(), roll, rtol=1e-6, atol=1e-8)


def test_matches_trl_generalized_jsd_loss():
    """TRL's own function (GKDTrainer.generalized_jsd_loss: one temperature for both, token-mean
    over labels != −100) against full_vocab_token_divergence + distill_loss."""
    pytest.importorskip("trl", reason="TRL is not installed in this environment (it is not a flyroll dependency)")
    try:
        from trl.experimental.gkd.gkd_trainer import GKDTrainer  # TRL 1.x
    except ImportError:
        try:
            from trl import GKDTrainer  # older TRL
        except ImportError:
            pytest.skip("this TRL has no GKDTrainer")
    student, teacher, _ = _random(4, B=3, T=4, V=9)
    student, teacher = student.float(), teacher.float()
    labels = torch.tensor([[1, 2, 3, -100], [4, -100, -100, -100], [0, 1, 2, 3]])
    mask = labels != -100
    for beta in (0.0, 0.1, 0.5, 0.9, 1.0):
        for temperature in (1.0, 2.0):
            trl_loss = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta,
                                                       temperature=temperature)
            per_token = full_vocab_token_divergence(student, teacher, divergence="jsd", beta=beta,
                                                    student_temperature=temperature,
                                                    teacher_temperature=temperature)
            ours, _ = distill_loss(per_token, mask)
            assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7), (beta, temperature)


# --- properties -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,opt", CASES)
def test_nonnegative_and_zero_on_equal_distributions(name, opt):
    for seed in range(4):
        student, teacher, ids = _random(seed)
        d = full_vocab_token_divergence(student, teacher, divergence=name, **opt)
        assert torch.all(d >= -1e-12)
        same = full_vocab_token_divergence(teacher, teacher, divergence=name, **opt)
        assert torch.allclose(same, torch.zeros_like(same), atol=1e-12)
        same_k = topk_token_divergence(teacher, ids, torch.log_softmax(teacher, -1).gather(-1, ids),
                                       divergence=name, **opt)
        assert torch.allclose(same_k, torch.zeros_like(same_k), atol=1e-12)
    # equal temperatures are not enough: τ_s ≠ τ_t on the same logits is a real divergence
    d = full_vocab_token_divergence(teacher, teacher, divergence="forward_kl", student_temperature=2.0)
    assert torch.all(d > 0)


def test_jsd_symmetries_and_ends():
    student, teacher, _ = _random(5)
    jsd = lambda a, b, beta: full_vocab_token_divergence(a, b, divergence="jsd", beta=beta)
    torch.testing.assert_close(jsd(student, teacher, 0.5), jsd(teacher, student, 0.5))
    torch.testing.assert_close(jsd(student, teacher, 0.2), jsd(teacher, student, 0.8))
    fkl = full_vocab_token_divergence(student, teacher, divergence="forward_kl")
    rkl = full_vocab_token_divergence(student, teacher, divergence="reverse_kl")
    torch.testing.assert_close(jsd(student, teacher, 0.0), fkl)
    torch.testing.assert_close(jsd(student, teacher, 1.0), rkl)
    # the interpolated formula itself vanishes towards the ends (TRL special-cases β = 0 and 1)
    assert torch.all(jsd(student, teacher, 1e-6) < 1e-4) and torch.all(jsd(student, teacher, 1 - 1e-6) < 1e-4)
    # a JSD is bounded by ln 2
    assert torch.all(jsd(student, teacher, 0.5) <= math.log(2))


def test_topk_with_k_equal_v_is_the_full_vocabulary():
    student, teacher, _ = _random(6, V=7)
    B, T, V = student.shape
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(V, generator=g) for _ in range(B * T)]).view(B, T, V)   # any order
    for name, opt in CASES:
        for temps in ((1.0, 1.0), (0.5, 2.0)):
            full = full_vocab_token_divergence(student, teacher, divergence=name, student_temperature=temps[0],
                                               teacher_temperature=temps[1], **opt)
            # raw logits or log-probs: the same distribution after renormalising over the k
            for teacher_k in (teacher.gather(-1, ids), torch.log_softmax(teacher, -1).gather(-1, ids)):
                topk = topk_token_divergence(student, ids, teacher_k, divergence=name, student_temperature=temps[0],
                                             teacher_temperature=temps[1], **opt)
                torch.testing.assert_close(topk, full, rtol=1e-9, atol=1e-12)


def test_minus_inf_teacher_entries_leave_the_support():
    student, teacher, ids = _random(7)
    teacher_logps = torch.log_softmax(teacher, -1).gather(-1, ids)         # [B,T,4]
    with_inf = teacher_logps.clone()
    with_inf[..., -1] = float("-inf")
    for name, opt in CASES:
        a = topk_token_divergence(student, ids, with_inf, divergence=name, **opt)
        b = topk_token_divergence(student, ids[..., :-1], teacher_logps[..., :-1], divergence=name, **opt)
        torch.testing.assert_close(a, b)
    # a position with no support at all gives 0, and no nan in the gradient
    s = student.clone().requires_grad_(True)
    empty = torch.full_like(teacher_logps, float("-inf"))
    d = topk_token_divergence(s, ids, empty, divergence="jsd", beta=0.5)
    assert torch.all(d == 0)
    d.sum().backward()
    assert torch.all(s.grad == 0)


@pytest.mark.parametrize("name,opt", [c for c in CASES if c[1].get("skew") != 1.0])   # skew 1: identically 0
def test_gradient_flows_to_the_student_only_on_masked_in_positions(name, opt):
    student, teacher, ids = _random(8)
    s = student.clone().requires_grad_(True)
    t = teacher.clone().requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, _ = distill_loss(topk_token_divergence(s, ids, t.gather(-1, ids), divergence=name, **opt), mask)
    loss.backward()
    assert torch.isfinite(s.grad).all()
    assert s.grad[mask.bool()].abs().sum() > 0
    assert torch.all(s.grad[~mask.bool()] == 0)
    assert t.grad is None or torch.all(t.grad == 0)                        # the teacher is a constant


def test_masked_positions_do_not_count():
    student, teacher, ids = _random(9)
    teacher_k = torch.log_softmax(teacher, -1).gather(-1, ids)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    base, _ = distill_loss(topk_token_divergence(student, ids, teacher_k), mask)
    changed = student.clone()
    changed[~mask.bool()] = torch.randn_like(changed[~mask.bool()]) * 50
    other, _ = distill_loss(topk_token_divergence(changed, ids, teacher_k), mask)
    assert other.item() == base.item()
    # and the value is the mean over the 3 unmasked positions
    per = topk_token_divergence(student, ids, teacher_k)
    assert base.item() == pytest.approx(float(per[mask.bool()].sum() / 3))


# --- SFT mix and aggregation ------------------------------------------------------------------
def test_sft_mix_matches_roll_and_splits_over_micro_batches():
    student, teacher, ids = _random(10, B=4)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, student.shape[-1], student.shape[:2], generator=g)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    labels = labels.masked_fill(mask == 0, -100)
    teacher_k = torch.log_softmax(teacher, -1).gather(-1, ids)
    div = topk_token_divergence(student, ids, teacher_k, divergence="reverse_kl")
    nll = sft_token_nll(student, labels)
    w = 0.3
    loss, m = distill_loss(div, mask, token_nll=nll, distill_loss_weight=w)
    # ROLL: (1 − w)·Σ nll / N + w·Σ div / N, N = unmasked positions (6); nll = −log softmax[label]
    logp = np.log(_softmax(student.numpy()))
    nll_np = [-logp[b, t, labels[b, t]] for b in range(4) for t in range(3) if mask[b, t]]
    div_np = [div[b, t].item() for b in range(4) for t in range(3) if mask[b, t]]
    assert m["distill/sft_nll"] == pytest.approx(sum(nll_np) / 6)
    assert m["distill/divergence"] == pytest.approx(sum(div_np) / 6)
    assert loss.item() == pytest.approx(w * sum(div_np) / 6 + (1 - w) * sum(nll_np) / 6)
    assert m["distill/loss"] == pytest.approx(loss.item())
    # gradient accumulation: micro-batches with the global count sum to the whole batch's loss
    parts = [distill_loss(div[i:i + 2], mask[i:i + 2], token_nll=nll[i:i + 2], distill_loss_weight=w,
                          num_tokens=6)[0] for i in (0, 2)]
    assert sum(p.item() for p in parts) == pytest.approx(loss.item())


def test_registry_and_bad_options():
    assert set(NAMES) <= set(DIVERGENCES)
    student, teacher, ids = _random(11)
    with pytest.raises(KeyError, match=r"unknown divergence 'kl'.*'forward_kl'.*'jsd'"):
        get_divergence("kl")
    with pytest.raises(KeyError, match="unknown divergence"):
        full_vocab_token_divergence(student, teacher, divergence="tvd")
    with pytest.raises(ValueError, match="beta must be in"):
        full_vocab_token_divergence(student, teacher, divergence="jsd", beta=1.5)
    with pytest.raises(ValueError, match="skew must be in"):
        full_vocab_token_divergence(student, teacher, divergence="skewed_forward_kl", skew=-0.1)
    with pytest.raises(ValueError, match="teacher_temperature must be > 0"):
        topk_token_divergence(student, ids, teacher.gather(-1, ids), teacher_temperature=0.0)
    with pytest.raises(TypeError):
        full_vocab_token_divergence(student, teacher, divergence="forward_kl", beta=0.5)   # not its option
    div = full_vocab_token_divergence(student, teacher)
    with pytest.raises(ValueError, match="pass token_nll"):
        distill_loss(div, torch.ones(2, 3), distill_loss_weight=0.5)
