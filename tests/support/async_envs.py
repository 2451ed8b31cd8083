"""The asynchronous manager's test helpers (tests/engines/agentic/test_async_env_manager.py, tests/infra/test_env_pool.py):
a prompt-hash engine deterministic under any batching, the lock-step reference and an async run."""

from __future__ import annotations

import dataclasses
import time
import zlib

from engines.agentic.async_env_manager import run_groups
from engines.agentic.env_manager import run_episodes
from engines.agentic.env_workers import EnvSpec, ThreadEnvPool
from engines.generation.engine import Completion, SamplingParams
from engines.generation.router import BatchingRouter
from engines.models.modeling import build_char_tokenizer

SAMPLING = SamplingParams(max_new_tokens=8, stop=("\n",))
CHOICES = ["left\n", "down\n", "right\n", "up\n", "jump\n", "down", "right"]


class PromptHashEngine:
    """Each completion is a function of its own prompt only (crc32 of the ids picks from CHOICES), so
    it does not depend on which requests share a call: deterministic under any batching. Counts calls."""

    def __init__(self, tok, delay_s: float = 0.0):
        self.tok, self.delay_s, self.batch_sizes = tok, delay_s, []

    def generate(self, prompt_token_ids, params, abort=None):
        self.batch_sizes.append(len(prompt_token_ids))
        time.sleep(self.delay_s)
        out = []
        for i, p in enumerate(prompt_token_ids):
            text = CHOICES[zlib.crc32(str(p).encode()) % len(CHOICES)]
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            out.append(Completion(i, 0, ids, [-0.5] * len(ids), "stop", text))
        return out[::-1]


def fields(ep):
    d = dataclasses.asdict(ep)
    d.pop("policy_versions")
    return d


def lockstep(env_name, seeds, *, G=2, max_turns=6, env_kwargs=None, engine_factory=None, chat=False,
             max_context_tokens=1500, sampling=SAMPLING):
    tok = build_char_tokenizer() if engine_factory is None else engine_factory.tok
    engine = (engine_factory or (lambda: PromptHashEngine(tok)))()
    return run_episodes(engine, tok, env_name, seeds, group_size=G, max_turns=max_turns, max_context_tokens=max_context_tokens,
                        sampling=sampling, env_kwargs=env_kwargs, chat=chat)


def run_async(env_name, seeds, *, G=2, max_turns=6, env_kwargs=None, pool=None, engine_factory=None, chat=False,
              max_context_tokens=1500, sampling=SAMPLING, **kwargs):
    tok = build_char_tokenizer() if engine_factory is None else engine_factory.tok
    router = BatchingRouter([(engine_factory or (lambda: PromptHashEngine(tok)))()], max_batch=16, max_wait_s=0.005)
    pool = pool or ThreadEnvPool(EnvSpec(env_name, env_kwargs or {}), threads=4)
    try:
        return run_groups(router, pool, tok, env_name, seeds, group_size=G, max_turns=max_turns,
                          max_context_tokens=max_context_tokens, sampling=sampling, chat=chat, **kwargs)
    finally:
        router.close()
        pool.shutdown()
