"""LoRA for the actor (Hu et al. 2021, arXiv 2106.09685), through peft: each target Linear's weight W
stays frozen and the update trains a low-rank delta, W' = W + (alpha / rank) * B @ A with
A [rank, in] and B [out, rank] (B starts at zero, so the wrapped model starts as the base).

What the rest of the pipeline sees does not change: the checkpoint a LoRA trainer publishes is the
plain Hugging Face model with the delta merged into each target weight (`merged_state_dict`), so
rollout, vLLM, evaluation and the reference stage load it as they load any policy. What only the
trainer needs -- the adapter weights (`adapter_state_dict`) and the key of the frozen base they sit
on -- goes into the trainer state beside the optimizer's (tasks/actors/train.py TrainWorker), so a
resume rebuilds base + adapter exactly, not from the merged (rounded) weights.

Departure from the paper: none in the maths; the adapters are placed on the attention and MLP
projections by default (the paper adapted W_q and W_v only; adapting every projection is the
usual choice for RL fine-tuning now, e.g. QLoRA arXiv 2305.14314).
"""

from __future__ import annotations

import torch
from torch import nn

# the attention and MLP projections of Llama / Qwen2 / Mistral-style decoders
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER = "default"  # peft's adapter name


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last name components of `model`'s Linear modules (what `target_modules` matches)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
               target_modules: tuple[str, ...] = DEFAULT_TARGETS) -> nn.Module:
    """`model` wrapped by peft's `get_peft_model` (in place: its target Linears become LoRA layers);
    only the adapters' A and B require grad. Refuses a target that names no Linear of `model`."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - the extra is in the test install
        raise ImportError("training.lora.rank > 0 needs peft: pip install 'flyroll[lora]'") from e
    if rank <= 0:
        raise ValueError(f"training.lora.rank={rank}: apply_lora needs rank > 0 (0 = LoRA off)")
    have = linear_names(model)
    missing = [t for t in target_modules if t not in have]
    if missing:
        raise ValueError(f"training.lora.target_modules: {missing} name no Linear module of {type(model).__name__}; "
                         f"expected names among {have}")
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules), bias="none",
                     task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def plain_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model under a peft wrapper (its target Linears still LoRA layers), or `model`."""
    return model.get_base_model() if is_lora(model) else model


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict (Hugging Face names) with every adapter merged: W + scaling * B @ A
    per target, computed on copies (the wrapped model is left as it is)."""
    from peft.tuners.lora import LoraLayer

    base = plain_model(model)
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    out = {}
    for name, t in base.state_dict().items():
        if ".lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = t.detach()
    for name, m in layers.items():
        w = m.base_layer.weight
        out[f"{name}.weight"] = (w + m.get_delta_weight(ADAPTER).to(w.dtype)).detach()
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable (adapter) parameters by name, as CPU copies: what a resume needs besides the base."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `adapter_state_dict` output back into `model`'s adapters; refuses a mismatched set of names."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(state):
        raise ValueError(f"LoRA adapter state does not fit the model: missing {sorted(set(params) - set(state))[:4]}, "
                         f"unexpected {sorted(set(state) - set(params))[:4]} (was training.lora changed between runs?)")
    for n, p in params.items():
        p.copy_(state[n])
