# longer than 400 lines: the four training strategies behind one Protocol, side by side
"""Training strategies: how one model and its optimizer are spread over N processes.

`torch` (one process, the default), `ddp` (torch DistributedDataParallel), `fsdp2` (torch
`fully_shard`: parameters, gradients and optimizer state sharded), `deepspeed_zero2` (optimizer state
and gradients sharded) and `deepspeed_zero3` (parameters too). All of them implement
`TrainStrategy`, so the training engines' loss code (micro-batching by token count, global
normalisers) is the same for every one.

The data-parallel contract, identical for every strategy:
- every rank holds the whole scored batch and walks the same shuffled mini-batch order (same seed);
  rank r trains on rows `mini[r::N]` of each mini-batch (`shard`);
- each micro-batch loss is normalised by the GLOBAL token / sequence count of the mini-batch, so the
  SUM over ranks of the gradients is the single-process gradient; every strategy's reduction
  AVERAGES over ranks, so `backward` multiplies the loss by N;
- every rank runs the same number of forward/backward passes (FSDP2 and ZeRO-3 gather parameters in
  each forward, DDP and ZeRO reduce in each backward): a rank with fewer micro-batches pads with
  zero-weighted copies of a real one (`micro_batches`).
With that, losses, gradient norms and updated parameters equal the single-process run up to float
summation order (tests/engines/training/test_strategies.py).

Checkpoints stay the Hugging Face directory the rest of the pipeline reads: `full_state_dict`
gathers the weights onto rank 0, and `optimizer_state_dict` gathers the optimizer into the plain
`torch.optim.AdamW.state_dict()` layout (integer ids in `model.parameters()` order), so a checkpoint
written with one strategy resumes with any other.

Process groups: `init_distributed` (gloo on CPU, NCCL on GPU) is called once per process; the Ray
training actors (tasks/actors/train.py) do it with MASTER_ADDR/PORT taken from rank 0's actor.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

STRATEGIES = ("torch", "ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3")
DEEPSPEED_INSTALL = "pip install 'flyroll[deepspeed]'  (or: pip install deepspeed)"

MakeOptimizer = Callable[[list], torch.optim.Optimizer]


class TrainStrategy(Protocol):
    """One model + its optimizer on `world_size` processes. Every method is called on every rank in
    the same order (most are collective)."""

    name: str
    rank: int
    world_size: int
    device: torch.device
    shared_prefix: bool  # the wrapped module may run two forwards (prompt, then responses) per backward
    grads_in_place: bool  # a backward may add into a parameter's .grad itself (nothing hooks what autograd hands it)

    def prepare(self, model: nn.Module, make_optimizer: MakeOptimizer, grad_clip: float) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap `model` and build its optimizer; returns (module to call forward on, the torch
        optimizer whose param_groups carry the learning rate, for the LR schedule)."""

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """Context for one forward + backward; `last` = the mini-batch's final one (gradients sync)."""

    def backward(self, loss: torch.Tensor) -> None:
        ...

    def step(self, optimizer: torch.optim.Optimizer) -> float:
        """Clip to `grad_clip`, step unless the norm is not finite, zero the gradients; returns the
        global gradient norm before clipping."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        ...

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective. The full weights on rank 0 when the module's own state_dict is sharded;
        None when it is complete on rank 0 (save the module as is)."""

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Collective. The plain AdamW state_dict layout (complete on rank 0)."""

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        ...


def shard(rows: list[int], rank: int, world_size: int) -> list[int]:
    """This rank's rows of a mini-batch (strided, so shards differ in size by at most one row)."""
    return rows[rank::world_size]


def micro_batches(splits: list[list[list[int]]], rank: int, fallback: list[int]) -> list[tuple[list[int], float]]:
    """(row indices, weight) per forward/backward of `rank`, padded to the longest rank's count.

    splits[r] = rank r's micro-batches (row indices). Padding entries reuse `fallback` (one real
    row) with weight 0, so every rank runs the same number of collectives and padding adds nothing."""
    n = max(len(s) for s in splits)
    mine = splits[rank]
    return [(mine[i], 1.0) if i < len(mine) else (fallback, 0.0) for i in range(n)]


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str | None = None) -> str:
    """Join the default process group (once per process); returns the backend ('gloo' / 'nccl')."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"process group already formed as rank {dist.get_rank()}/{dist.get_world_size()}, "
                               f"asked for rank {rank}/{world_size}")
        return dist.get_backend()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size)
    return backend


def _device() -> torch.device:
    """cuda:0 under NCCL (Ray gives each actor its own GPU as device 0), else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if torch.cuda.device_count() > 1 else 0)
    return torch.device("cpu")


def _clip_and_step(params: list, optimizer, grad_clip: float) -> float:
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # DTensor (FSDP2)
        grad_norm = grad_norm.full_tensor()
    if torch.isfinite(grad_norm):
        optimizer.step()
    return float(grad_norm)


class TorchStrategy:
    """One process, no wrapping: the plain PyTorch path (and the reference for the others)."""

    name, rank, world_size = "torch", 0, 1
    shared_prefix = True
    grads_in_place = True

    def __init__(self):
        self.device = torch.device("cpu")
        self.model, self.grad_clip = None, 1.0

    def prepare(self, model, make_optimizer, grad_clip):
        self.model, self.grad_clip = model, grad_clip
        self.device = next(model.parameters()).device
        return model, make_optimizer(list(model.parameters()))

    def micro_batch(self, last):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def step(self, optimizer):
        return _clip_and_step(list(self.model.parameters()), optimizer, self.grad_clip)

    def zero_grad(self, optimizer):
        optimizer.zero_grad(set_to_none=True)

    def all_reduce_sum(self, values):
        return list(values)

    def full_state_dict(self):
        return None

    def optimizer_state_dict(self, optimizer):
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer, state):
        optimizer.load_state_dict(state)


class _Distributed(TorchStrategy):
    """What every multi-process strategy shares: rank, world size, loss scale, metric reduction.
    Their wrappers (DDP's reducer, FSDP2's reshard hooks, DeepSpeed's engine) are built around one
    forward per backward, so they run every row's prompt (`engines.models.batching` shared_prefix off), and
    they reduce or reshard the gradients autograd hands them, so no backward writes `.grad` itself."""

    shared_prefix = False
    grads_in_place = False

    def __init__(self):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(f"strategy {self.name!r} needs a process group: call engines.training.strategies.init_distributed first")
        self.rank, self.world_size, self.device = dist.get_rank(), dist.get_world_size(), _device()

    def backward(self, loss):
        (loss * self.world_size).backward()  # the reduction averages; the global normaliser wants a sum

    def all_reduce_sum(self, values):
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()


class DDPStrategy(_Distributed):
    """torch DistributedDataParallel: full replicas, gradients all-reduced in the last micro-batch's
    backward (`no_sync` before it)."""

    name = "ddp"

    def prepare(self, model, make_optimizer, grad_clip):
        from torch.nn.parallel import DistributedDataParallel

        self.model, self.grad_clip = model.to(self.device), grad_clip
        self.ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return self.ddp, make_optimizer(list(model.parameters()))

    def micro_batch(self, last):
        return contextlib.nullcontext() if last else self.ddp.no_sync()


class FSDP2Strategy(_Distributed):
    """torch `fully_shard` (FSDP2): each transformer block (the model's `_no_split_modules`) and the
    root are sharded over the ranks; gradients are reduce-scattered in every backward.

    `param_dtype` (e.g. torch.bfloat16): FSDP2's `MixedPrecisionPolicy` -- the sharded parameters
    (the master weights, and AdamW's state) stay in their dtype (float32), each forward all-gathers
    and computes with a `param_dtype` copy, and gradients are reduce-scattered in `reduce_dtype`
    (default float32) into float32 gradients. None (the default): the parameters are gathered in
    their own dtype (float32: twice the all-gather bytes of bf16; the engine's autocast then casts
    per op)."""

    name = "fsdp2"

    def __init__(self, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = torch.float32):
        super().__init__()
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def prepare(self, model, make_optimizer, grad_clip):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.model, self.grad_clip = model.to(self.device), grad_clip
        self.names = [n for n, _ in model.named_parameters()]  # the optimizer's id order
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        kw = {}
        if self.param_dtype is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
        blocks = set()
        for m in model.modules():
            blocks |= set(getattr(m, "_no_split_modules", None) or ())
        for m in model.modules():
            if type(m).__name__ in blocks:
                fully_shard(m, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        return model, make_optimizer(list(model.parameters()))

    def full_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state_dict(self, optimizer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        sd = get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return {}
        ids = {n: i for i, n in enumerate(self.names)}
        return {"state": {ids[n]: s for n, s in sd["state"].items()},
                "param_groups": [{**g, "params": [ids[n] for n in g["params"]]} for g in sd["param_groups"]]}

    def load_optimizer_state_dict(self, optimizer, state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        sd = {"state": {self.names[i]: s for i, s in state["state"].items()},
              "param_groups": [{**g, "params": [self.names[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(self.model, optimizer, sd, options=StateDictOptions(full_state_dict=True))


def check_zero_optimization(entries: dict, field: str = "training.zero_optimization") -> None:
    """Refuse DeepSpeed `zero_optimization` entries flyroll sets itself (`stage`: the strategy's name) and,
    where DeepSpeed is installed, any it does not know or whose value it rejects (its own config model,
    which forbids unknown names), naming `field` and the entry."""
    if "stage" in entries:
        raise ValueError(f"{field}.stage: the ZeRO stage comes from training.strategy (deepspeed_zero2 / deepspeed_zero3); "
                         "remove it here")
    if not entries:
        return
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:
        return  # the strategy refuses to start without DeepSpeed (DEEPSPEED_INSTALL)
    from pydantic import ValidationError

    try:
        DeepSpeedZeroConfig(**entries)
    except ValidationError as e:
        wrong = "; ".join(f"{field}.{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r})"
                          for err in e.errors())
        raise ValueError(f"DeepSpeed refuses {wrong}") from None


class DeepSpeedStrategy(_Distributed):
    """DeepSpeed ZeRO stage 2 or 3 around a torch AdamW (`zero_allow_untested_optimizer`, so no
    DeepSpeed optimizer op is compiled). DeepSpeed clips (`gradient_clipping`) and steps at the
    accumulation boundary, which `micro_batch(last=True)` marks. On CPU DeepSpeed builds one C++ op
    (its shared-memory all-reduce) on first use; `TORCH_EXTENSIONS_DIR` caches it (default
    ~/.cache/flyroll/torch_extensions)."""

    def __init__(self, stage: int, config_overrides: dict | None = None):
        self.name = f"deepspeed_zero{stage}"
        super().__init__()
        self.stage, self.overrides = stage, config_overrides or {}

    def prepare(self, model, make_optimizer, grad_clip):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/flyroll/torch_extensions"))
        try:
            import deepspeed
        except ImportError as e:
            raise ImportError(f"training.strategy {self.name!r} needs DeepSpeed: {DEEPSPEED_INSTALL}") from e
        check_zero_optimization(self.overrides.get("zero_optimization", {}))
        self.model, self.grad_clip = model.to(self.device), grad_clip
        config = {
            "train_micro_batch_size_per_gpu": 1,    # batch sizes are the engine's business; unused here
            "gradient_accumulation_steps": 1,
            "gradient_clipping": grad_clip,
            "zero_optimization": {"stage": self.stage, **self.overrides.get("zero_optimization", {})},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**62,
            **{k: v for k, v in self.overrides.items() if k != "zero_optimization"},
        }
        base = make_optimizer(list(model.parameters()))
        self.ds, _, _, _ = deepspeed.initialize(model=model, optimizer=base, config=config, dist_init_required=False)
        self.zero = self.ds.optimizer  # DeepSpeedZeroOptimizer(_Stage3) around `base`
        self.params = list(model.parameters())
        return self.ds, base  # ZeRO keeps base's param_group dicts, so an LR schedule on base drives it

    @contextlib.contextmanager
    def micro_batch(self, last):
        self.ds.set_gradient_accumulation_boundary(last)
        yield

    def backward(self, loss):
        self.ds.backward(loss * self.world_size, scale_wrt_gas=False)
        if not self.ds.is_gradient_accumulation_boundary():
            self.ds.step()  # bookkeeping only off the boundary; the update happens in `step`

    def step(self, optimizer):
        self.ds.step()  # reduce, clip, update, zero grads
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def zero_grad(self, optimizer):
        self.ds.zero_grad()

    def full_state_dict(self):
        if self.stage < 3:
            return None  # ZeRO-2 all-gathers the updated parameters into every replica
        import deepspeed

        with deepspeed.zero.GatheredParameters(self.params, modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()} if self.rank == 0 else {}

    def optimizer_state_dict(self, optimizer):
        from deepspeed.utils import safe_get_full_optimizer_state

        base = self.zero.optimizer
        keys = sorted({k for s in base.state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})
        state = {}
        for i, p in enumerate(self.params):
            full = {k: safe_get_full_optimizer_state(p, k) for k in keys}  # collective
            if full and all(v is not None for v in full.values()):
                steps = [s["step"] for s in base.state.values() if "step" in s]
                state[i] = {"step": steps[0].detach().clone().cpu() if steps else torch.tensor(0.0),
                            **{k: v.detach().cpu().clone() for k, v in full.items()}}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
        ids = list(range(len(self.params)))
        return {"state": state, "param_groups": [{**groups[0], "params": ids}] + [{**g, "params": []} for g in groups[1:]]}

    def load_optimizer_state_dict(self, optimizer, state):
        from deepspeed.utils import safe_set_full_optimizer_state

        base = self.zero.optimizer
        first = next(iter(state["state"].values()), None)
        if first is None:
            return
        # AdamW creates its state lazily: make the slots to fill, one per flat fp32 partition (ZeRO-3
        # swaps its sub-groups into base.param_groups only while stepping, so ask it for them)
        flats = getattr(self.zero, "fp32_partitioned_groups_flat", None) or [f for g in base.param_groups for f in g["params"]]
        for flat in flats:
            base.state[flat] = {k: (v.detach().clone() if k == "step" else torch.zeros_like(flat)) for k, v in first.items()}
        if hasattr(self.zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-2 links param -> state slices at its first step
            self.zero._hp_optimizer_states_linked = False
            self.zero._lazy_init_hp_params_optimizer_state()
        for i, p in enumerate(self.params):
            for k, v in state["state"][i].items():
                if k != "step":
                    safe_set_full_optimizer_state(p, v.to(self.device), k)
        for group, saved in zip(base.param_groups, state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})


_REGISTRY: dict[str, Callable[..., TrainStrategy]] = {
    "torch": TorchStrategy,
    "ddp": DDPStrategy,
    "fsdp2": FSDP2Strategy,
    "deepspeed_zero2": lambda **kw: DeepSpeedStrategy(2, **kw),
    "deepspeed_zero3": lambda **kw: DeepSpeedStrategy(3, **kw),
}


def make_strategy(name: str, **kwargs) -> TrainStrategy:
    """A fresh strategy by config name (`training.strategy`); multi-process ones need
    `init_distributed` first. kwargs go to the DeepSpeed strategies (config_overrides) and to
    fsdp2 (param_dtype, reduce_dtype: its mixed-precision policy)."""
    if name not in _REGISTRY:
        raise ValueError(f"training.strategy {name!r} is not one of {list(STRATEGIES)}")
    return _REGISTRY[name](**kwargs)
