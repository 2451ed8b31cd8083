"""Sleep / wake of the HF generation engine (engines/generation/engine.py), what a colocated generator does
while the trainer beside it runs (placement.offload_generation, docs/placement.md): level 1 hands the
generation buffers back, level 2 frees the weights; woken weights serve nothing until an update fills
them; once filled the engine generates the same tokens as before it slept. The pipeline through Ray
actors is tests/tasks/stages/test_training_colocated_offload.py; the memory it saves, benchmarks/colocation_memory.py."""

from __future__ import annotations

import copy

import pytest
import torch

from engines.generation.engine import HFGenerationEngine, SamplingParams
from engines.models.modeling import build_tiny_policy
from tests.support.engines import PROMPTS, encode

torch.set_num_threads(1)

PARAMS = SamplingParams(n=3, max_new_tokens=8, seed=5)


def _run(engine, tok):
    return [(c.token_ids, c.logprobs) for c in engine.generate(encode(tok, PROMPTS), PARAMS)]


def test_sleep_level_2_refuses_to_generate_until_the_woken_weights_are_filled(tiny_policy, tiny_model_dir):
    model, tok = tiny_policy
    trainer = copy.deepcopy(model)  # what a live sync sends: the same weights, from another module
    engine = HFGenerationEngine(copy.deepcopy(model), tok)
    engine.finish_weight_update(0)
    before = _run(engine, tok)

    engine.sleep(2)
    assert engine.version is None and engine.asleep == {"weights", "kv_cache"}
    assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match=r"no weights to generate from: they were freed by sleep\(2\)"):
        _run(engine, tok)
    with pytest.raises(RuntimeError, match=r"wake_up\(\['weights'\]\) before updating them"):
        engine.update_weights(trainer.named_parameters())

    engine.wake_up(["weights"])  # allocated, not filled: still no policy
    assert engine.asleep == {"kv_cache"}
    with pytest.raises(RuntimeError, match="woken but not filled"):
        _run(engine, tok)
    engine.update_weights(trainer.named_parameters(), version=1)  # a live sync's full update
    engine.wake_up(["kv_cache"])
    assert engine.asleep == set() and engine.version == 1
    assert _run(engine, tok) == before
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()  # still tied

    engine.sleep(2)   # the store path: load_weights fills them
    engine.wake_up(["weights"])
    engine.load_weights(tiny_model_dir, version=2)
    assert engine.version == 2 and _run(engine, tok) == before   # generating wakes the cache


def test_sleep_level_1_keeps_the_weights_and_bad_levels_or_tags_are_refused(tiny_policy):
    model, tok = tiny_policy
    engine = HFGenerationEngine(copy.deepcopy(model), tok)
    before = _run(engine, tok)
    engine.sleep(1)
    assert engine.asleep == {"kv_cache"}
    assert _run(engine, tok) == before and engine.asleep == set()
    with pytest.raises(ValueError, match=r"sleep\(level=3\): expected 1 .* or 2"):
        engine.sleep(3)
    with pytest.raises(ValueError, match=r"wake_up\(tags=\['kv'\]\): expected a non-empty subset of \['weights', 'kv_cache'\]"):
        engine.wake_up(["kv"])


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_sleep_level_2_hands_the_weight_memory_back():
    """RSS falls by at least half the weight bytes (a 4-layer, 512-wide model: ~40 MB of float32 weights),
    as in an engine actor, whose heap keeps freed memory (engines/models/host_memory.py)."""
    from engines.models.host_memory import keep_freed_memory

    keep_freed_memory()
    model, tok = build_tiny_policy(hidden_size=512, num_layers=4, num_heads=8, max_positions=128, seed=0)
    engine = HFGenerationEngine(model.eval(), tok)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    _run(engine, tok)
    awake = _rss()
    engine.sleep(2)
    asleep = _rss()
    assert awake - asleep >= weight_bytes / 2, (awake, asleep, weight_bytes)
    engine.wake_up(["weights"])
    assert _rss() - asleep < weight_bytes * 1.5   # allocated again (pages are touched when filled)
