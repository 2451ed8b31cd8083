"""The reference actor: `ReferenceWorker` computes reference and old log-probs and critic values inside a
stage's Ray cluster.

Each actor holds one engine and the policy version it has loaded; asked for another version it
updates its weights in place (no restart). On a local run the actors are named per run and reused
by every task (see infra/ray_session.py); on a cluster they live as long as the task's Ray cluster.
"""

from __future__ import annotations

import typing

import ray

from tasks.actors.process import engine_process, placed

# Everything else is imported inside the actor's methods, on purpose: an actor's process sets its torch
# threads (`engine_process`) before torch and the engines load, and a driver importing this module
# (to create the actor) loads none of them.

if typing.TYPE_CHECKING:  # annotations only (the actor imports at run time, inside its methods)
    from engines.training.rollout_batch import RolloutBatch


@ray.remote
class ReferenceWorker:
    """Reference-model log-probs, the current policy's (old) log-probs and, for PPO with GAE, the
    current critic's values, on the rollout tokens."""

    def __init__(self, threads: int = 1, devices: dict | None = None):
        """`devices`: {"reference": (device, dtype), "critic": (device, dtype)}: the policy and
        reference models are cast to the reference role's dtype on its device; the critic keeps its
        float32 weights there and runs under autocast in the critic's dtype, as it trains. None = cpu, float32."""
        engine_process(threads)
        self.devices = devices
        self.models: dict[str, tuple] = {}  # which ("reference"/"policy"/"critic") -> (key, model)
        self.pad = 0  # the tokenizer's pad id once a policy is loaded (padding is masked: any id works)

    def load(self, which: str, spec, key: str) -> None:
        """which="critic": the critic published with policy checkpoint `key` (fresh from its
        backbone when it has none: the first iteration)."""
        if which in self.models and self.models[which][0] == key:
            return
        from engines.models.modeling import load_policy
        from tasks.run.common import TRAINER_STATE, TRAINING_ONLY, fetch_cached

        if which == "critic":  # its weights (and the policy's, for a fresh one), not the optimizer state
            from engines.training.critic_model import critic_for_checkpoint

            device, _ = placed(self.devices, "reference")
            critic = critic_for_checkpoint(fetch_cached(spec, key, skip=(TRAINER_STATE,)))
            self.models[which] = (key, critic.to(device).eval())
            return
        from engines.models.devices import place_model

        device, dtype = placed(self.devices, "reference")
        model, tok = load_policy(fetch_cached(spec, key, skip=TRAINING_ONLY), dtype=dtype)
        self.models[which] = (key, place_model(model, device, dtype).eval())
        self.pad = tok.pad_token_id

    def pad_id(self) -> int:
        return self.pad

    def release(self) -> None:
        """Drop every model and hand their memory back (placement.offload_reference); the next `load`
        reads them again from the local checkpoint cache (frozen or published: the same bits)."""
        from engines.models.host_memory import release_allocator_caches

        self.models.clear()
        release_allocator_caches()

    def logprobs(self, which: str, batch: RolloutBatch, micro_batch: int, temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of model `which` on every response token of `batch` (a RolloutBatch), one list per row,
        under softmax(logits / `temperature`): the sampling temperature, as the update computes the
        policy's (a π_old or KL reference at another temperature differs from the policy at equal weights)."""
        from engines.models.batching import batched_logprobs

        lp = batched_logprobs(self.models[which][1], batch.tokens(loss_mask=False), micro_batch=micro_batch,
                              temperature=temperature)
        return [lp[i, :n].tolist() for i, n in enumerate(batch.response_lengths.tolist())]

    def sequence_logprobs(self, which: str, tokens, max_tokens: int) -> tuple[list[float], list[float]]:
        """(summed, token-mean) log-probs of each row's masked response tokens of `tokens` (a TokenBatch:
        the preference pairs, engines/training/supervised.py `pair_batch`) under model `which`."""
        from engines.training.supervised import reference_sequence_logps

        return reference_sequence_logps(self.models[which][1], tokens, max_tokens)

    def topk_logprobs(self, which: str, tokens, k: int, max_tokens: int) -> list[tuple[list, list]]:
        """Model `which`'s k most likely next tokens and their log-probs at each response position of
        each row of `tokens` (a TokenBatch of demonstrations): the distillation teacher's top-k
        (engines/training/supervised.py `teacher_topk`)."""
        from engines.training.supervised import teacher_topk

        return teacher_topk(self.models[which][1], tokens, k, max_tokens)

    def values(self, batch: RolloutBatch, micro_batch: int) -> list[list[float]]:
        """Critic values V(s_t), one per response token of `batch` (a RolloutBatch)."""
        from engines.training.critic_model import batched_values
        from engines.models.devices import autocast_dtype, torch_dtype

        critic_dtype = torch_dtype((self.devices or {}).get("critic", ("cpu", "float32"))[1])  # on the reference device
        v = batched_values(self.models["critic"][1], batch.tokens(loss_mask=False), micro_batch=micro_batch,
                           autocast_dtype=autocast_dtype(critic_dtype))
        return [v[i, :n].tolist() for i, n in enumerate(batch.response_lengths.tolist())]
