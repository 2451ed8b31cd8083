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

    def episodes(self, env_name: str, seeds: list[int], group_size: int, max_turns: int, max_context_tokens: int, params, env_kwargs: dict):
        """Multi-turn episodes with this engine (engines/env_manager.py), one batched generate per turn."""
        from engines.env_manager import run_episodes

        return run_episodes(self.engine, self.tokenizer, env_name, seeds, group_size=group_size, max_turns=max_turns,
                            max_context_tokens=max_context_tokens, sampling=params, env_kwargs=env_kwargs)

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
            meta = sample.get("metadata") if isinstance(sample.get("metadata"), dict) else {}
            try:
                fn = get_reward((routes or {}).get(domain) or meta.get("reward_fn") or domain)
            except KeyError as e:
                out.append((0.0, str(e)))
                continue
            res, hung = score_isolated(fn, response, sample, timeout_s, self.pool)
            hung_any |= hung
            out.append((res.reward, res.error))
        return out, hung_any


@ray.remote
class ReferenceWorker:
    """Reference-model log-probs, the current policy's (old) log-probs and, for PPO with GAE, the
    current critic's values, on the rollout tokens."""

    def __init__(self, threads: int = 1):
        _threads(threads)
        self.models: dict[str, tuple] = {}  # which ("reference"/"policy"/"critic") -> (key, model)

    def load(self, which: str, spec, key: str) -> None:
        """which="critic": the critic published with policy checkpoint `key` (fresh from its
        backbone when it has none: the first iteration)."""
        if which in self.models and self.models[which][0] == key:
            return
        from engines.modeling import load_policy
        from tasks.common import fetch_cached

        if which == "critic":
            from engines.critic_model import critic_for_checkpoint

            self.models[which] = (key, critic_for_checkpoint(fetch_cached(spec, key)).eval())
            return
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

    def values(self, prompt_ids: list, response_ids: list, pad_id: int, micro_batch: int) -> list[list[float]]:
        """Critic values V(s_t), one per response token."""
        from engines.batching import collate
        from engines.critic_model import batched_values

        batch = collate(prompt_ids, response_ids, pad_id)
        v = batched_values(self.models["critic"][1], batch, micro_batch=micro_batch)
        return [v[i, : len(r)].tolist() for i, r in enumerate(response_ids)]


@ray.remote
class TrainWorker:
    """The actor's training engine (model + optimizer state), the critic's for PPO with GAE, and the
    objective's state across iterations (KL controller, EMA baseline, running reward statistics);
    one update per call. All of it is saved in the checkpoint and restored from it."""

    def __init__(self, threads: int = 1):
        _threads(threads)
        self.key, self.model, self.tokenizer, self.engine = None, None, None, None
        self.critic_engine, self.algo_state = None, None

    def load(self, spec, key: str, training_cfg: dict, algorithm_cfg: dict | None = None) -> str:
        if self.key == key:
            return "cached"
        import torch

        from engines.modeling import load_policy
        from engines.rl_step import AlgorithmState
        from engines.training import TorchCriticEngine, TorchTrainEngine
        from tasks.common import fetch_cached

        model_dir = fetch_cached(spec, key)
        self.model, self.tokenizer = load_policy(model_dir)
        opt = dict(weight_decay=training_cfg["weight_decay"], grad_clip=training_cfg["grad_clip"],
                   warmup_steps=training_cfg["warmup_steps"])
        self.engine = TorchTrainEngine(self.model, lr=training_cfg["lr"], **opt)
        path = os.path.join(model_dir, "trainer_state.pt")
        state = torch.load(path, weights_only=True) if os.path.exists(path) else {}
        if state:  # resume optimizer moments and LR schedule
            self.engine.load_state_dict(state)
        self.algo_state = AlgorithmState.from_dict(state.get("algorithm"))
        self.critic_engine = None
        if (algorithm_cfg or {}).get("advantage") == "gae":
            from engines.critic_model import critic_for_checkpoint

            self.critic_engine = TorchCriticEngine(critic_for_checkpoint(model_dir), lr=algorithm_cfg["critic_lr"], **opt)
            if "critic" in state:
                self.critic_engine.load_state_dict(state["critic"])
        self.key = key
        return "loaded"

    def step(self, table, algorithm_cfg: dict, training_cfg: dict, temperature: float, seed: int, next_key: str,
             train_actor: bool = True) -> tuple[dict, dict[str, bytes]]:
        """One update (critic, then actor unless `train_actor` is False: critic warmup) on a scored
        table; returns (metrics, checkpoint files as bytes, the critic under critic/)."""
        import tempfile

        import torch

        from configs.algorithm import AlgorithmConfig
        from engines.critic_model import CRITIC_SUBDIR, save_critic
        from engines.modeling import save_policy
        from engines.rl_step import prepare_update, table_to_batch, token_column

        cfg = AlgorithmConfig.model_validate(algorithm_cfg)
        batch = table_to_batch(table, self.tokenizer.pad_token_id)
        T = batch.responses.shape[1]
        update = prepare_update(table, batch, cfg, self.algo_state)
        batch.response_mask = update.response_mask
        metrics = dict(update.metrics)
        sizes = dict(mini_batch_size=training_cfg["mini_batch_size"],
                     max_tokens_per_micro_batch=training_cfg["max_tokens_per_micro_batch"], seed=seed)
        if self.critic_engine is not None:
            metrics.update(self.critic_engine.train_step(batch, update.returns, update.values, cfg, **sizes))
        if train_actor:
            old = token_column(table, "old_logprobs", T)
            ref = token_column(table, "ref_logprobs", T)
            behaviour = token_column(table, "behaviour_logprobs", T) if cfg.tis_cap is not None else None
            metrics.update(self.engine.train_step(batch, update.advantages, old, ref, cfg, temperature=temperature,
                                                  rollout_logprobs=behaviour, kl_coef=update.kl_coef, **sizes))
        self.algo_state = update.state
        trainer_state = {**self.engine.state_dict(), "algorithm": update.state.to_dict()}
        if self.critic_engine is not None:
            trainer_state["critic"] = self.critic_engine.state_dict()
        with tempfile.TemporaryDirectory() as d:
            save_policy(self.model, self.tokenizer, d)
            if self.critic_engine is not None:
                save_critic(self.critic_engine.critic, os.path.join(d, CRITIC_SUBDIR))
            torch.save(trainer_state, os.path.join(d, "trainer_state.pt"))
            files = {}
            for root, _, names in os.walk(d):
                for n in names:
                    p = os.path.join(root, n)
                    with open(p, "rb") as f:
                        files[os.path.relpath(p, d)] = f.read()
        self.key = next_key  # what weight_sync will publish these weights as
        return metrics, files
