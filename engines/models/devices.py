"""Where a role's model lives and in which dtype: the one helper every engine actor goes through.

The config (`placement.<role>.device` / `.dtype`, configs/schema.py) is resolved per role by
`resolve_device` (here, so a machine without flytekit can print a role's placement;
`infra.resources.placement_plan` calls it with the GPUs the role's worker requests) into plain
strings ("cpu" / "cuda", "float32" / "bfloat16" / "float16"); the actors in tasks/actors/ and
tasks/actors/train.py hand those strings here.

Two ways a dtype is used:
- **inference roles** (actor_infer, reference, reward): the weights are cast to the dtype
  (`place_model`), so the KV cache and activations are in it too;
- **training roles** (actor_train, critic): mixed precision -- the parameters stay float32 (the
  master weights; AdamW's moments are made from them, so they are float32 too) and each forward
  runs under `torch.autocast(device, dtype)` (`mixed_precision`): matmuls in bf16, reductions and
  the loss in float32. This is the effect of FSDP's MixedPrecisionPolicy with float32 parameters and
  of verl's actor; autocast casts per op instead of once per forward (more casts, same numbers up to
  rounding). float16 training would need loss scaling, which is not built (the config refuses it).
Log-probs are computed in float32 from the (bf16) logits either way (engines/models/batching.py
`response_logprobs`: `logits.float()` before the log-softmax), as verl does.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str, dtype: str, gpus: float) -> tuple[str, str]:
    """A role's (device, dtype) from its config values and the GPUs its worker requests: device
    'auto' = 'cuda' when `gpus` > 0, else 'cpu'; dtype 'auto' = 'bfloat16' on cuda, 'float32' on cpu."""
    if device == "auto":
        device = "cuda" if gpus > 0 else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, dtype


def torch_dtype(name: str) -> torch.dtype:
    """"bfloat16" -> torch.bfloat16 (the config's dtype names)."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def torch_device(name: str, role: str = "this role") -> torch.device:
    """"cpu" / "cuda" -> a torch device this process can use; a CUDA device that is not there fails
    here, naming the role, instead of deep inside the first forward."""
    if name not in ("cpu", "cuda"):
        raise ValueError(f"placement.{role}.device {name!r}: expected 'cpu' or 'cuda' (resolved, not 'auto')")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"placement.{role}.device resolved to 'cuda' but this process sees no CUDA device "
                           f"(torch.cuda.is_available() is False; torch {torch.__version__}); give the role a GPU "
                           f"(placement.{role}.gpu, or FLYROLL_PROFILE=gpu on a GPU cluster) or set placement.{role}.device: cpu")
    return torch.device(name)


def place_model(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """An inference model on `device` with its floating-point weights (and buffers) cast to `dtype`."""
    return model.to(device=device, dtype=dtype)


def autocast_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The autocast dtype of a training role: None for float32 (plain float32 training)."""
    return None if dtype == torch.float32 else dtype


@contextlib.contextmanager
def mixed_precision(device: torch.device, dtype: torch.dtype | None):
    """`torch.autocast(device.type, dtype)` around a training forward; nothing for None / float32."""
    if dtype is None or dtype == torch.float32:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield
