"""The training side of the engines on a tiny char-level Qwen2 (seconds on one CPU thread): the
actor update (`engines/training/update.py`: micro-batching by tokens, loss masks, normalisation, skipped
rows, the tied embedding's gradient). The batch layout and per-token log-probs have their own file,
tests/engines/models/test_batching.py; shared-prefix log-probs too, tests/engines/generation/test_engine_shared_prefix.py."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from engines.algorithms.aggregate import global_counts
from engines.algorithms.config import AlgorithmConfig
from engines.algorithms.objective import actor_loss
from engines.models.batching import response_logprobs
from engines.training.update import TorchTrainEngine, balance_split, split_by_tokens
from tests.support.engines import params_of, rl_batch

torch.set_num_threads(1)

# ================================================================================================
# training
# ================================================================================================

def sgd_engine(model, lr: float = 0.5) -> TorchTrainEngine:
    """The training engine with its AdamW swapped for plain SGD, so parameter updates are linear in
    the gradient (Adam's first step is ~lr·sign(g), which hides gradient differences)."""
    engine = TorchTrainEngine(model)
    engine.optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)
    return engine


def assert_same_update(params, want, base, atol: float) -> None:
    """`params` equal `want` within `atol`, and `want` is a real update of `base`'s parameters."""
    start = params_of(base)
    assert max(float((want[k] - start[k]).abs().max()) for k in start) > 1e-3  # a real update
    for k in start:
        torch.testing.assert_close(params[k], want[k], atol=atol, rtol=0, msg=k)


def test_train_step_changes_parameters(tiny_policy):
    model = copy.deepcopy(tiny_policy[0])
    batch, adv, old, ref = rl_batch(tiny_policy[1], model)
    before = params_of(model)
    engine = TorchTrainEngine(model, lr=1e-3)
    m = engine.train_step(batch, adv, old, ref, AlgorithmConfig(), mini_batch_size=4, max_tokens_per_micro_batch=64)
    after = params_of(model)
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every tensor moved
    assert m["actor/updates"] == 2.0
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/kl_loss"):
        assert key in m and m[key] == m[key]
    assert model.training


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_update_does_not_depend_on_micro_batch_size(tiny_policy, mode):
    base, tok = tiny_policy
    cfg = AlgorithmConfig(loss_agg_mode=mode, entropy_coef=0.01)
    batch, adv, old, ref = rl_batch(tok, base)
    results = []
    for cap in (1, 10**9):  # every row alone vs one micro-batch per mini-batch
        model = copy.deepcopy(base)
        m = sgd_engine(model).train_step(batch, adv, old, ref, cfg, mini_batch_size=4, max_tokens_per_micro_batch=cap)
        results.append((params_of(model), m))
    (p_small, m_small), (p_big, m_big) = results
    assert_same_update(p_small, p_big, base, atol=1e-5)
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert m_small[k] == pytest.approx(m_big[k], abs=1e-5), k


def test_masked_tokens_get_zero_gradient(tiny_policy):
    model, tok = tiny_policy
    model = copy.deepcopy(model)
    cfg = AlgorithmConfig(entropy_coef=0.01)
    batch, adv, old, ref = rl_batch(tok, model)
    mask = batch.response_mask
    assert (mask == 0).any() and (mask == 1).any()
    adv = adv + 100.0 * (1 - mask)  # huge values behind the mask must not matter
    logp, ent = response_logprobs(model, batch, with_entropy=True)
    logp.retain_grad()
    ent.retain_grad()
    n_tok, n_seq = global_counts(mask)
    loss, _ = actor_loss(cfg, logp, old, ref, adv, mask, entropy=ent, num_tokens=n_tok, num_seqs=n_seq)
    loss.backward()
    assert (logp.grad[mask == 0] == 0).all() and (ent.grad[mask == 0] == 0).all()
    assert (logp.grad[mask == 1] != 0).any() and (ent.grad[mask == 1] != 0).any()


def test_masked_tokens_do_not_change_the_update(tiny_policy):
    base, tok = tiny_policy
    batch, adv, old, ref = rl_batch(tok, base)
    off = 1 - batch.response_mask
    runs = {}
    for name, (a, o, r) in {
        "clean": (adv, old, ref),
        "junk_behind_mask": (adv + 1e3 * off, old - 30.0 * off, ref - 30.0 * off),
        "control": (adv + 0.5 * batch.response_mask, old, ref),  # an unmasked change does move it
    }.items():
        model = copy.deepcopy(base)
        sgd_engine(model).train_step(batch, a, o, r, AlgorithmConfig(), mini_batch_size=8, max_tokens_per_micro_batch=64)
        runs[name] = params_of(model)
    for k in runs["clean"]:
        torch.testing.assert_close(runs["junk_behind_mask"][k], runs["clean"][k], atol=1e-6, rtol=0, msg=k)
    assert any(not torch.allclose(runs["control"][k], runs["clean"][k], atol=1e-6) for k in runs["clean"])


def zero_advantage_batch(tok, model):
    """rl_batch with rows 0, 3, 4 and 6 at zero advantage and old log-probs off the policy (ratios != 1)."""
    batch, adv, old, ref = rl_batch(tok, model)
    adv = adv.clone()
    adv[[0, 3, 4, 6]] = 0.0
    return batch, adv, old - 0.1 * batch.response_mask, ref


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo"])
def test_zero_advantage_rows_are_skipped_without_changing_the_update(tiny_policy, loss):
    """Half the rows carry no advantage: skipping their forward/backward gives the same parameters and
    loss as running them, over two epochs of shuffled mini-batches of 4 (some hold no advantage at all)."""
    base, tok = tiny_policy
    batch, adv, old, _ = zero_advantage_batch(tok, base)
    runs = {}
    for skip in (False, True):
        model = copy.deepcopy(base)
        cfg = AlgorithmConfig(policy_loss=loss, use_kl_loss=False, kl_coef=0.0, skip_zero_advantage=skip, ppo_epochs=2)
        m = sgd_engine(model).train_step(batch, adv, old, None, cfg, mini_batch_size=4, max_tokens_per_micro_batch=64)
        runs[skip] = (params_of(model), m)
    (p_all, m_all), (p_skip, m_skip) = runs[False], runs[True]
    assert m_all["actor/skipped_rows"] == 0.0
    assert 0.25 <= m_skip["actor/skipped_rows"] <= 0.5  # 4 of 8 rows, less one kept per mini-batch with no signal
    assert_same_update(p_skip, p_all, base, atol=1e-6)
    for k in ("actor/pg_loss", "actor/grad_norm"):
        assert m_skip[k] == pytest.approx(m_all[k], abs=1e-6), k


def test_an_update_with_no_advantage_at_all_still_steps_adamw(tiny_policy):
    """Every row at zero advantage: one row still runs, so AdamW gets zero gradients (not none) and
    its momentum and weight decay move the parameters exactly as when every row runs."""
    base, tok = tiny_policy
    batch, adv, old, _ = zero_advantage_batch(tok, base)
    results = []
    for skip in (False, True):
        model = copy.deepcopy(base)
        engine = TorchTrainEngine(model, lr=1e-3, weight_decay=0.1)
        cfg = AlgorithmConfig(use_kl_loss=False, kl_coef=0.0, skip_zero_advantage=skip)
        first = cfg.model_copy(update={"skip_zero_advantage": False})  # the same AdamW state in both runs
        engine.train_step(batch, adv, old, None, first, mini_batch_size=8, max_tokens_per_micro_batch=64)
        before = params_of(model)
        m = engine.train_step(batch, torch.zeros_like(adv), old, None, cfg, mini_batch_size=8, max_tokens_per_micro_batch=64)
        results.append((params_of(model), m))
        assert any(not torch.equal(before[k], results[-1][0][k]) for k in before)  # momentum moved them
    (p_all, _), (p_skip, m_skip) = results
    assert m_skip["actor/skipped_rows"] == 7 / 8
    for k in p_all:
        torch.testing.assert_close(p_skip[k], p_all[k], atol=0, rtol=0, msg=k)


def test_a_kl_loss_with_zero_coefficient_does_not_stop_the_skip(tiny_policy):
    """use_kl_loss with β = 0 (kl_coef 0, or the controller's value passed in) adds no gradient: rows
    with zero advantage are still left out, and the update equals running them."""
    base, tok = tiny_policy
    batch, adv, old, ref = zero_advantage_batch(tok, base)
    runs = []
    for skip in (False, True):
        model = copy.deepcopy(base)
        cfg = AlgorithmConfig(use_kl_loss=True, kl_coef=0.01, skip_zero_advantage=skip)
        m = sgd_engine(model).train_step(batch, adv, old, ref, cfg, mini_batch_size=8, max_tokens_per_micro_batch=64,
                                         kl_coef=0.0)
        runs.append((params_of(model), m))
    assert runs[0][1]["actor/skipped_rows"] == 0.0 and runs[1][1]["actor/skipped_rows"] == 0.5
    for k in runs[0][0]:
        torch.testing.assert_close(runs[1][0][k], runs[0][0][k], atol=1e-6, rtol=0, msg=k)


def test_entropy_metric_is_over_the_rows_that_ran(tiny_policy):
    base, tok = tiny_policy
    batch, adv, old, _ = zero_advantage_batch(tok, base)
    with torch.no_grad():
        _, ent = response_logprobs(base, batch, with_entropy=True)
    ran = [1, 2, 5, 7]
    want = float((ent[ran] * batch.response_mask[ran]).sum() / batch.response_mask[ran].sum())
    cfg = AlgorithmConfig(use_kl_loss=False, kl_coef=0.0)
    m = TorchTrainEngine(copy.deepcopy(base), lr=1e-3).train_step(batch, adv, old, None, cfg, mini_batch_size=8,
                                                                 max_tokens_per_micro_batch=64)
    assert m["actor/skipped_rows"] == 0.5 and m["actor/entropy"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("cfg", [
    AlgorithmConfig(use_kl_loss=True, kl_coef=0.01),                     # the KL term has a gradient on every row
    AlgorithmConfig(use_kl_loss=False, kl_coef=0.0, entropy_coef=0.01),  # so has the entropy bonus
    AlgorithmConfig(use_kl_loss=False, kl_coef=0.0, skip_zero_advantage=False),
], ids=["kl_loss", "entropy_bonus", "off"])
def test_zero_advantage_rows_run_when_the_loss_needs_them(tiny_policy, cfg):
    base, tok = tiny_policy
    batch, adv, old, ref = zero_advantage_batch(tok, base)
    m = TorchTrainEngine(copy.deepcopy(base), lr=1e-3).train_step(batch, adv, old, ref, cfg, mini_batch_size=8,
                                                                 max_tokens_per_micro_batch=64)
    assert m["actor/skipped_rows"] == 0.0


@pytest.mark.parametrize("cfg", [
    AlgorithmConfig(),                                                   # GRPO: k3 KL loss
    AlgorithmConfig(use_kl_loss=False, kl_coef=0.0, policy_loss="gspo"),
    AlgorithmConfig(use_kl_loss=False, kl_coef=0.0, tis_cap=2.0),        # TIS compares π_old with the engine's
], ids=["grpo_kl_loss", "gspo", "tis"])
def test_old_logprobs_from_the_update_equal_a_recompute(tiny_policy, cfg):
    """One on-policy pass: π_old = the micro-batch's own log-probs, detached (old_logprobs=None)
    gives the same parameters, loss and TIS weights as π_old recomputed by a separate forward."""
    base, tok = tiny_policy
    batch, adv, old, ref = rl_batch(tok, base)
    g = torch.Generator().manual_seed(3)
    behaviour = (old + 0.3 * (torch.rand(old.shape, generator=g) - 0.5)) * batch.response_mask  # a mismatched engine
    runs = []
    for o in (old, None):
        model = copy.deepcopy(base)
        m = sgd_engine(model).train_step(batch, adv, o, ref, cfg, mini_batch_size=8, max_tokens_per_micro_batch=64,
                                         rollout_logprobs=behaviour)
        runs.append((params_of(model), m))
    (p_re, m_re), (p_in, m_in) = runs
    assert_same_update(p_in, p_re, base, atol=1e-6)
    for k in ("actor/pg_loss", "actor/grad_norm") + (("actor/tis_weight_mean",) if cfg.tis_cap else ()):
        assert m_in[k] == pytest.approx(m_re[k], abs=1e-6), k
    assert "actor/behaviour_logprob_mae" not in m_re
    want = float(((old - behaviour).abs() * batch.response_mask).sum() / batch.response_mask.sum())
    assert m_in["actor/behaviour_logprob_mae"] == pytest.approx(want, rel=0.05)  # micro-batch means, weighted by rows


def test_old_logprobs_in_update_only_for_one_on_policy_pass():
    auto = AlgorithmConfig()
    assert auto.old_logprobs == "auto" and auto.old_logprobs_in_update(rows=64, mini_batch_size=64)
    assert not auto.old_logprobs_in_update(rows=65, mini_batch_size=64)                    # two optimizer steps
    assert not AlgorithmConfig(ppo_epochs=2).old_logprobs_in_update(8, 64)                # a second epoch is off-policy
    assert not AlgorithmConfig(use_kl_loss=False, kl_coef=0.01).old_logprobs_in_update(8, 64)  # KL in the rewards
    assert AlgorithmConfig(use_kl_loss=False, kl_coef=0.0).old_logprobs_in_update(8, 64)
    for mode in ("recompute", "behaviour"):
        assert not AlgorithmConfig(old_logprobs=mode).old_logprobs_in_update(8, 64)


@pytest.mark.slow
def test_compiled_decoder_layers_give_the_same_update(tiny_policy):
    """training.compile: the update with torch.compile'd decoder layers (inductor on CPU here) moves
    the parameters as the eager one does, runs plain forwards (no shared prefix), and keeps the
    checkpoint's parameter names. Groups of 4 rows share a prompt, as GRPO's samples do."""
    base, tok = tiny_policy
    batch, adv, old, ref = rl_batch(tok, base)
    rows = [0, 0, 0, 0, 1, 1, 1, 1]
    same, adv, old, ref = batch.select(rows), adv[rows], old[rows], ref[rows]
    runs = {}
    for compile in (False, True):
        model = copy.deepcopy(base)
        engine = TorchTrainEngine(model, compile=compile)
        engine.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)
        m = engine.train_step(same, adv, old, ref, AlgorithmConfig(), mini_batch_size=8, max_tokens_per_micro_batch=64)
        runs[compile] = (params_of(model), m, engine)
    (p_eager, m_eager, eager), (p_comp, m_comp, engine) = runs[False], runs[True]
    assert eager.shared_prefix and not eager.compiled
    assert not engine.shared_prefix and engine.compiled == [f"layers.{i}" for i in range(len(base.model.layers))]
    assert list(p_comp) == list(p_eager)  # no _orig_mod prefixes: the checkpoint loads anywhere
    assert_same_update(p_comp, p_eager, base, atol=1e-5)
    assert m_comp["actor/pg_loss"] == pytest.approx(m_eager["actor/pg_loss"], abs=1e-5)


@pytest.mark.parametrize("rows", [None, [0, 0, 0, 0, 1, 1, 1, 1]], ids=["distinct", "shared-prefix"])
def test_tied_embedding_gradient_in_place_gives_the_same_update(tiny_policy, rows):
    """The tied embedding's backward into `.grad` (engines/training/update.py tied_embedding_grad_in_place):
    the same update as nn.Embedding's own backward, with distinct prompts and with groups sharing
    their prefix (two lookups per micro-batch), over several micro-batches; the parameter's
    gradient is one dense tensor and autograd never sums [V, H] gradients out of place."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from engines.training.model_patches import TiedEmbedding

    class OutOfPlaceVocabAdds(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.add.Tensor and args[0].shape == base.get_input_embeddings().weight.shape:
                OutOfPlaceVocabAdds.count += 1
            return func(*args, **(kwargs or {}))

    base, tok = tiny_policy
    batch, adv, old, ref = rl_batch(tok, base)
    if rows is not None:
        batch, adv, old, ref = batch.select(rows), adv[rows], old[rows], ref[rows]
    runs, adds = {}, {}
    for in_place in (False, True):
        model = copy.deepcopy(base)
        engine = sgd_engine(model)
        emb = model.get_input_embeddings()
        assert engine.tied_embedding_in_place and type(emb) is TiedEmbedding  # tiny_policy ties its embeddings
        if not in_place:
            emb.__class__ = torch.nn.Embedding
        OutOfPlaceVocabAdds.count = 0
        with OutOfPlaceVocabAdds():
            engine.train_step(batch, adv, old, ref, AlgorithmConfig(), mini_batch_size=4, max_tokens_per_micro_batch=48)
        assert emb.weight.grad.layout == torch.strided and model.get_output_embeddings().weight is emb.weight
        runs[in_place], adds[in_place] = params_of(model), OutOfPlaceVocabAdds.count
    assert_same_update(runs[True], runs[False], base, atol=1e-6)
    assert adds[True] == 0 < adds[False]


def test_tied_embedding_lookup_adds_its_rows_into_grad():
    """`_LookupGradIntoWeight`: repeated ids sum, the padding row gets nothing, and an existing
    `.grad` is added to in place (the same tensor afterwards)."""
    from engines.training.model_patches import TiedEmbedding

    torch.manual_seed(0)
    ref = torch.nn.Embedding(7, 3, padding_idx=0)
    emb = copy.deepcopy(ref)
    emb.__class__ = TiedEmbedding
    ids = torch.tensor([[1, 1, 0, 4], [6, 0, 1, 2]])
    g = torch.randn(2, 4, 3)
    ref(ids).backward(g)
    emb(ids).backward(g)
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad, rtol=0, atol=1e-6)
    assert emb.weight.grad[0].abs().sum() == 0 and emb.weight.grad[3].abs().sum() == 0
    held = emb.weight.grad
    emb(ids).backward(g)
    assert emb.weight.grad is held
    torch.testing.assert_close(held, 2 * ref.weight.grad, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(emb(ids), ref(ids))


def test_untied_embeddings_keep_their_own_backward(tiny_policy):
    """Without a tied LM head the embedding keeps nn.Embedding's backward, and an AdamW update runs."""
    base, tok = tiny_policy
    model = type(base)(type(base.config)(**{**base.config.to_dict(), "tie_word_embeddings": False}))
    engine = TorchTrainEngine(model, lr=1e-3)
    assert not engine.tied_embedding_in_place and type(model.get_input_embeddings()) is torch.nn.Embedding
    batch, adv, old, ref = rl_batch(tok, model)
    before = params_of(model)
    engine.train_step(batch, adv, old, ref, AlgorithmConfig(), mini_batch_size=8, max_tokens_per_micro_batch=64)
    assert not torch.equal(before["model.embed_tokens.weight"], params_of(model)["model.embed_tokens.weight"])


def test_compile_needs_decoder_layers():
    from engines.training.model_patches import compile_decoder_layers

    with pytest.raises(ValueError, match="no decoder layers"):
        compile_decoder_layers(torch.nn.Linear(2, 2))


def test_split_by_tokens_worked_example():
    # cap 16: [5,3] -> 5*2=10; adding 8 -> 8*3=24 > 16, new group; [8,2] -> 16 ok; a third -> 24;
    # [2] + 9 -> 18 > 16; [9] + 1 -> 18 > 16; [1]
    assert split_by_tokens([5, 3, 8, 2, 2, 9, 1], 16) == [[0, 1], [2, 3], [4], [5], [6]]
    assert split_by_tokens([20, 3], 16) == [[0], [1]]  # a row longer than the cap goes alone
    assert split_by_tokens([], 16) == []


@pytest.mark.parametrize("seed", range(5))
def test_split_by_tokens_respects_the_cap(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 50))]
    cap = rng.randint(8, 120)
    groups = split_by_tokens(lengths, cap)
    assert [i for g in groups for i in g] == list(range(len(lengths)))  # order kept, all rows once
    for g in groups:
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= cap


def test_balance_split_spreads_rows_evenly_over_whole_groups():
    """An 8 x 8 GRPO batch (prompts 45 tokens, responses 32, cap 4096): greedy fills 53 rows (77 x 53
    = 4081 tokens) and leaves 11, a group cut in two; balanced gives 32 + 32, four whole groups each."""
    n, ids = 64, [i // 8 for i in range(64)]
    assert [len(r) for r in split_by_tokens([45] * n, 4096, [32] * n)] == [53, 11]
    assert balance_split([45] * n, 4096, [32] * n, ids) == [list(range(32)), list(range(32, 64))]
    # 3 micro-batches of 8 groups: cuts at 21.3 / 42.7 snap to the group boundaries 24 and 40
    assert [len(r) for r in balance_split([45] * n, 2000, [32] * n, ids)] == [24, 16, 24]
    # without prompt ids: equal row counts
    assert [len(r) for r in balance_split([45] * n, 2000, [32] * n)] == [21, 22, 21]


def test_balance_split_falls_back_to_greedy_when_even_runs_break_the_cap():
    lengths = [30, 1, 1, 1, 1, 1]  # a long first row: any even run holding it with others is over the cap
    assert balance_split(lengths, 32) == split_by_tokens(lengths, 32) == [[0], [1, 2, 3, 4, 5]]


@pytest.mark.parametrize("seed", range(5))
def test_balance_split_keeps_rows_count_and_cap(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 60)
    lengths, resp = [rng.randint(1, 40) for _ in range(n)], [rng.randint(1, 20) for _ in range(n)]
    ids = sorted(rng.randint(0, 6) for _ in range(n))
    cap = rng.randint(60, 400)
    runs = balance_split(lengths, cap, resp, ids)
    assert [i for r in runs for i in r] == list(range(n))
    assert len(runs) == len(split_by_tokens(lengths, cap, resp))
    for r in runs:
        assert len(r) == 1 or len(r) * (max(lengths[i] for i in r) + max(resp[i] for i in r)) <= cap


def test_micro_batch_forward_respects_the_token_cap(tiny_policy):
    """BUG (engines/training/update.py): `split_by_tokens` sizes micro-batches by each row's own length,
    but `train_step` feeds `batch.select(idx)` at the full batch width P+T, so one long response
    makes every micro-batch a multiple of the cap (the documented memory knob
    `max_tokens_per_micro_batch` = padded tokens per forward does not hold)."""
    base, tok = tiny_policy
    model = copy.deepcopy(base)
    batch, adv, old, ref = rl_batch(tok, model, long_row=40)
    cap = 64
    assert int(batch.attention_mask.sum(-1).max()) <= cap  # every row fits the cap on its own
    seen = []
    forward = model.forward

    def counting_forward(*args, **kwargs):
        seen.append(kwargs["input_ids"].numel())
        return forward(*args, **kwargs)

    model.forward = counting_forward
    TorchTrainEngine(model).train_step(batch, adv, old, ref, AlgorithmConfig(), mini_batch_size=8, max_tokens_per_micro_batch=cap)
    assert seen and max(seen) <= cap, f"padded tokens per micro-batch forward: {seen} (cap {cap})"


# --- a loss or gradient that is not finite (issue 60) ---------------------------------------------------

@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_a_non_finite_loss_stops_the_update_naming_the_metric(tiny_policy, poison):
    """An advantage of inf / NaN (an unbounded reward let through) makes the loss non-finite: the update raises
    NonFiniteUpdate naming the metric and where, and no optimizer step touched the weights -- before, the step
    was skipped silently (actor/pg_loss=nan, every update a no-op) and the run went on."""
    from engines.training.update import NonFiniteUpdate

    model = copy.deepcopy(tiny_policy[0])
    batch, adv, old, ref = rl_batch(tiny_policy[1], model)
    adv = adv.clone()
    adv[1] = float(poison)
    before = params_of(model)
    engine = TorchTrainEngine(model, lr=1e-3)
    with pytest.raises(NonFiniteUpdate, match=r"actor/pg_loss is (nan|inf|-inf) at update 1 \(epoch 1, mini-batch \d\)"):
        engine.train_step(batch, adv, old, ref, AlgorithmConfig(), mini_batch_size=8, max_tokens_per_micro_batch=64)
    after = params_of(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_non_finite_gradient_stops_the_update(tiny_policy):
    """A finite loss whose gradient is not (a parameter poisoned to inf after the forward) stops at the step."""
    from engines.training.update import NonFiniteUpdate

    model = copy.deepcopy(tiny_policy[0])
    batch, adv, old, ref = rl_batch(tiny_policy[1], model)
    engine = TorchTrainEngine(model, lr=1e-3)
    hook = next(model.parameters()).register_hook(lambda g: torch.full_like(g, float("inf")))
    try:
        with pytest.raises(NonFiniteUpdate, match=r"actor/grad_norm is (inf|nan) at update 1"):
            engine.train_step(batch, adv, old, ref, AlgorithmConfig(), mini_batch_size=8, max_tokens_per_micro_batch=64)
    finally:
        hook.remove()
