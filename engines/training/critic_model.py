"""The critic for PPO with GAE: the policy's transformer backbone with a scalar value head.

`critic_from_policy` builds it from a policy model directory (the backbone's weights, the LM head
dropped, a fresh `nn.Linear(hidden, 1)` head initialised to zero so every first value is exactly 0
and two processes that build it from the same policy get the same critic); `save_critic` /
`load_critic` write and read a directory of `config.json` + `model.safetensors`, which lives in the
`critic/` subfolder of a policy checkpoint (CRITIC_SUBDIR). `response_values` gives V(s_t) for each
response token with the same layout as `engines.models.batching.response_logprobs`.

Notation: B rows, P prompt width, T response width, H hidden size.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import AutoConfig, AutoModel

from engines.models.batching import TokenBatch

CRITIC_SUBDIR = "critic"
_WEIGHTS = "model.safetensors"


class ValueModel(nn.Module):
    """backbone (a transformers base model, e.g. Qwen2Model) + value_head (H -> 1)."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)

    @property
    def config(self):
        return self.backbone.config

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """Values [B, P+T]: one scalar per position (the value of the state that ends there)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state                  # [B, P+T, H]
        with torch.autocast(hidden.device.type, enabled=False):                    # the head in its own dtype, under bf16 autocast too
            return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()  # [B, P+T]


def critic_from_policy(policy_dir: str, dtype: torch.dtype = torch.float32) -> ValueModel:
    """A critic initialised from the policy in `policy_dir` (backbone weights), value head = 0."""
    backbone = AutoModel.from_pretrained(policy_dir, dtype=dtype)
    critic = ValueModel(backbone)
    nn.init.zeros_(critic.value_head.weight)
    nn.init.zeros_(critic.value_head.bias)
    return critic


def save_critic(critic: ValueModel, path: str, state_dict: dict | None = None) -> str:
    """config.json + model.safetensors (backbone.* and value_head.* tensors) into `path`.
    `state_dict`: the full weights when `critic`'s own are sharded (engines/training/strategies.py)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    critic.backbone.config.save_pretrained(path)
    state = {k: v.detach().contiguous().clone() for k, v in (critic.state_dict() if state_dict is None else state_dict).items()}
    save_file(state, os.path.join(path, _WEIGHTS), metadata={"format": "pt", "flyroll": "critic"})
    return path


def load_critic(path: str, dtype: torch.dtype = torch.float32) -> ValueModel:
    """The critic saved by `save_critic` in `path`."""
    from safetensors.torch import load_file

    if not os.path.isfile(os.path.join(path, _WEIGHTS)):
        raise FileNotFoundError(f"critic directory {path!r} holds no {_WEIGHTS} (expected one written by save_critic)")
    critic = ValueModel(AutoModel.from_config(AutoConfig.from_pretrained(path)))
    critic.load_state_dict(load_file(os.path.join(path, _WEIGHTS)))
    return critic.to(dtype)


def critic_for_checkpoint(model_dir: str) -> ValueModel:
    """The critic published with the policy checkpoint `model_dir`, or a fresh one from its backbone
    (the first iteration of a run, whose starting policy has no critic yet)."""
    sub = os.path.join(model_dir, CRITIC_SUBDIR)
    return load_critic(sub) if os.path.isfile(os.path.join(sub, _WEIGHTS)) else critic_from_policy(model_dir)


def response_values(critic: ValueModel, batch: TokenBatch, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """V(s_t) [B, T] float32 for each response token t: the value at the position before it (P+t-1),
    the state the policy saw when it sampled t (verl's layout). `autocast_dtype` (bf16 training,
    engines/models/devices.py): the backbone runs under torch.autocast in it; the value head does not."""
    from engines.models.devices import mixed_precision

    P, T = batch.prompt_width, batch.responses.shape[1]
    with mixed_precision(batch.input_ids.device, autocast_dtype):
        values = critic(batch.input_ids, batch.attention_mask, batch.position_ids)  # [B, P+T]
    return values[:, P - 1 : P + T - 1]                                            # [B, T]


@torch.no_grad()
def batched_values(critic: ValueModel, batch: TokenBatch, micro_batch: int = 64,
                   autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`response_values` in micro-batches without grad, zero on padding; [B, T] float32 on the
    batch's device (each micro-batch runs on the critic's, under `autocast_dtype` as in training)."""
    critic.eval()
    device = next(critic.parameters()).device
    parts = [response_values(critic, batch.select(slice(s, s + micro_batch)).to(device), autocast_dtype).to(batch.input_ids.device)
             for s in range(0, batch.input_ids.shape[0], micro_batch)]
    return torch.cat(parts) * batch.response_mask
