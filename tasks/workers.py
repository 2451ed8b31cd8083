"""Ray actors that host the engines inside a stage's Ray cluster.

Each actor holds one engine and the policy version it has loaded; asked for another version it
updates its weights in place (no restart). On a local run the actors are named per run and reused
by every task (see infra/ray_session.py); on a cluster they live as long as the task's Ray cluster.
"""

from __future__ import annotations

import concurrent.futures as cf
import os

import ray


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


@ray.remote
class GenerationWorker:
    """A generation engine (`hf`) for rollouts and evaluation."""

    def __init__(self, threads: int = 1, micro_batch: int = 256):
        _threads(threads)
        self.engine, self.tokenizer, self.key, self.micro_batch = None, None, None, micro_batch

    def load(self, spec, key: str) -> str:
        """Make `key` the served policy: first load, or an in-place weight update."""
        if self.key == key:
            return "cached"
        from engines.generation import HFGenerationEngine
        from engines.modeling import load_policy
        from tasks.common import fetch_cached

        model_dir = fetch_cached(spec, key)

        if self.engine is None:
            model, self.tokenizer = load_policy(model_dir)
            self.engine = HFGenerationEngine(model, self.tokenizer, micro_batch=self.micro_batch)
            how = "loaded"
        else:
            self.engine.load_weights(model_dir)
            how = "updated in place"
        self.key = key
        return how

    def encode(self, prompts: list[str], chat: bool) -> list[list[int]]:
        from engines.evaluation import encode_prompts

        return encode_prompts(self.tokenizer, prompts, chat)

    def generate(self, prompt_token_ids: list[list[int]], params):
        return self.engine.generate(prompt_token_ids, params)

    def evaluate(self, table, max_new_tokens: int, chat: bool):
        from engines.evaluation import evaluate

        return evaluate(self.engine, self.tokenizer, table, max_new_tokens=max_new_tokens, apply_chat_template=chat)


@ray.remote
class RewardWorker:
    """Scores samples with the domain's reward function, each call isolated (timeout, exceptions)."""

    def __init__(self, threads: int = 4):
        self.pool = cf.ThreadPoolExecutor(max_workers=threads)

    def score(self, items: list[tuple[str, str, dict]], timeout_s: float, routes: dict[str, str] | None = None) -> tuple[list[tuple[float, str | None]], bool]:
        """items: (domain, response, sample) -> ([(reward, error)], hung). hung = a call is still stuck.
        routes: domain -> reward function name (config `reward.functions`)."""
        from engines.rewards import get_reward, score_isolated

        out, hung_any = [], False
        for domain, response, sample in items:
            try:
                fn = get_reward((routes or {}).get(domain, domain))
            except KeyError as e:
                out.append((0.0, str(e)))
                continue
            res, hung = score_isolated(fn, response, sample, timeout_s, self.pool)
            hung_any |= hung
            out.append((res.reward, res.error))
        return out, hung_any


@ray.remote
class ReferenceWorker:
    """Reference-model log-probs, and the current policy's (old) log-probs, on the rollout tokens."""

    def __init__(self, threads: int = 1):
        _threads(threads)
        self.models: dict[str, tuple] = {}  # which ("reference"/"policy") -> (key, model)

    def load(self, which: str, spec, key: str) -> None:
        if which in self.models and self.models[which][0] == key:
            return
        from engines.modeling import load_policy
        from tasks.common import fetch_cached

        model, tok = load_policy(fetch_cached(spec, key))
        self.models[which] = (key, model.eval())
        self.pad = tok.pad_token_id

    def pad_id(self) -> int:
        return self.pad

    def logprobs(self, which: str, prompt_ids: list, response_ids: list, pad_id: int, micro_batch: int) -> list[list[float]]:
        from engines.batching import batched_logprobs, collate

        batch = collate(prompt_ids, response_ids, pad_id)
        lp = batched_logprobs(self.models[which][1], batch, micro_batch=micro_batch)
        return [lp[i, : len(r)].tolist() for i, r in enumerate(response_ids)]


@ray.remote
class TrainWorker:
    """The actor's training engine: model + optimizer state, one update per call."""

    def __init__(self, threads: int = 1):
        _threads(threads)
        self.key, self.model, self.tokenizer, self.engine = None, None, None, None

    def load(self, spec, key: str, training_cfg: dict) -> str:
        if self.key == key:
            return "cached"
        import torch

        from engines.modeling import load_policy
        from engines.training import TorchTrainEngine
        from tasks.common import fetch_cached

        model_dir = fetch_cached(spec, key)
        self.model, self.tokenizer = load_policy(model_dir)
        self.engine = TorchTrainEngine(
            self.model, lr=training_cfg["lr"], weight_decay=training_cfg["weight_decay"],
            grad_clip=training_cfg["grad_clip"], warmup_steps=training_cfg["warmup_steps"],
        )
        state = os.path.join(model_dir, "trainer_state.pt")
        if os.path.exists(state):  # resume optimizer moments and LR schedule
            self.engine.load_state_dict(torch.load(state, weights_only=True))
        self.key = key
        return "loaded"

    def step(self, table, algorithm_cfg: dict, training_cfg: dict, temperature: float, seed: int, next_key: str) -> tuple[dict, dict[str, bytes]]:
        """One actor update on a scored table; returns (metrics, checkpoint files as bytes)."""
        import tempfile

        import torch

        from configs.algorithm import AlgorithmConfig
        from engines.modeling import save_policy
        from engines.rl_step import advantages_from_table, table_to_batch, token_column

        cfg = AlgorithmConfig.model_validate(algorithm_cfg)
        batch = table_to_batch(table, self.tokenizer.pad_token_id)
        T = batch.responses.shape[1]
        advantages, mask, metrics = advantages_from_table(table, batch, cfg)
        batch.response_mask = mask
        old = token_column(table, "old_logprobs", T)
        ref = token_column(table, "ref_logprobs", T)
        metrics.update(
            self.engine.train_step(
                batch, advantages, old, ref, cfg,
                mini_batch_size=training_cfg["mini_batch_size"],
                max_tokens_per_micro_batch=training_cfg["max_tokens_per_micro_batch"],
                temperature=temperature, seed=seed,
            )
        )
        with tempfile.TemporaryDirectory() as d:
            save_policy(self.model, self.tokenizer, d)
            torch.save(self.engine.state_dict(), os.path.join(d, "trainer_state.pt"))
            files = {}
            for root, _, names in os.walk(d):
                for n in names:
                    p = os.path.join(root, n)
                    with open(p, "rb") as f:
                        files[os.path.relpath(p, d)] = f.read()
        self.key = next_key  # what weight_sync will publish these weights as
        return metrics, files
