"""Unit tests of the supervised bootstrap (engines/training/pretrain.py), on a tiny char-level Qwen2 built in the test
(seconds on one CPU thread)."""

from __future__ import annotations

import torch

from engines.models.modeling import build_tiny_policy
from engines.training.pretrain import supervised_finetune
from engines.data.synthetic import make_problems

torch.set_num_threads(1)

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, max_positions=128)  # as the `tiny_policy` fixture


def test_supervised_finetune_lowers_the_loss():
    model, tok = build_tiny_policy(**TINY, seed=1)
    probs = make_problems("bootstrap", 32)
    losses = []
    m = supervised_finetune(model, tok, [(p.prompt, p.answer) for p in probs], steps=30, batch_size=16,
                            lr=3e-3, on_step=lambda step, loss: losses.append(loss))
    assert len(losses) == 30
    assert losses[0] > 3.0  # ~ln(54) for a random model
    assert sum(losses[-5:]) / 5 < 0.75 * losses[0]
    assert m["bootstrap/steps"] == 30.0 and m["bootstrap/loss"] < losses[0]
    assert not model.training


def test_supervised_finetune_takes_any_number_of_steps():
    """A short warm start (model.warm_start.steps) is a valid config: 10 steps raised ZeroDivisionError in
    OneCycleLR (a 10% warmup of 10 steps is a phase of length 0), and every count must run and learn."""
    for steps in (1, 2, 3, 9, 10, 11, 19):
        model, tok = build_tiny_policy(**TINY, seed=1)
        losses = []
        supervised_finetune(model, tok, [("1+2=", "3")], steps=steps, batch_size=4, lr=3e-3,
                            on_step=lambda step, loss: losses.append(loss))
        assert len(losses) == steps and all(loss == loss for loss in losses)   # ran every step, no NaN
        if steps >= 3:
            assert losses[-1] < losses[0], (steps, losses)


def test_supervised_finetune_trains_only_the_marked_segments():
    """A response given as (text, trained) segments: as a string when every segment is trained; an
    untrained segment's tokens carry no loss (what it says cannot change the update), a trained one's do.
    solved_episodes(segments=True) marks exactly the actions and joins to the same text."""
    from engines.agentic.env_manager import solved_episodes

    def trained(pairs):
        model, tok = build_tiny_policy(**TINY, seed=1)
        supervised_finetune(model, tok, pairs, steps=3, batch_size=2, lr=1e-2, seed=0)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    p = "frozenlake: walk p to g.\nmove: "
    assert torch.equal(trained([(p, "down\n....\nmove: up\n")]),
                       trained([(p, [("down\n", True), ("....\nmove: ", True), ("up\n", True)])]))
    quiet = [trained([(p, [("down\n", True), (reply, False)])]) for reply in ("p...\nmove: ", "o.g.\nmove: ")]
    assert torch.equal(*quiet)
    loud = [trained([(p, [("down\n", True), (reply, True)])]) for reply in ("p...\nmove: ", "o.g.\nmove: ")]
    assert not torch.equal(*loud)

    plain = solved_episodes("frozenlake", list(range(6)), max_turns=10, env_kwargs={"neighbours": True}, habit_rate=0.5)
    split = solved_episodes("frozenlake", list(range(6)), max_turns=10, env_kwargs={"neighbours": True}, habit_rate=0.5,
                            segments=True)
    assert [(q, "".join(t for t, _ in segs)) for q, segs in split] == plain
    for _, segs in split:
        assert [t.strip() in ("left", "down", "right", "up") for t, _ in segs] == [a for _, a in segs]
        assert segs[-1][1]                                                   # ends on an action
