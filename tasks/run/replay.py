"""`checkpoint.optimizer_every`: which versions hold their trainer state, and exact resume without it.

trainer_state.pt (AdamW moments, LR schedule, objective state, LoRA adapters, the critic's optimizer)
is 2/3 of a float32 checkpoint. With `checkpoint.optimizer_every: N` a version holds it only when
`trainer_state_due` says so; in between, the training actor keeps it in memory (TrainWorker.load
answers "cached" for the version it just trained) and publish_weights records the version as
deferred (manifest metadata `trainer_state_deferred`).

Training from a deferred version without that actor (a resumed run; a cluster whose actors died)
rebuilds the state by replay: from the newest earlier version of the run that holds trainer_state.pt
(or the run's starting policy, which is how iteration 1 starts anyway), the update of every later
iteration is run again on that iteration's published rollout table (tasks/stages/reference.py) with the
arguments `train` passed (`update_args`). The replayed weights are then compared with the published
ones: equal (same code, threads and hardware) means the state is exactly what training had; else
the published weights are kept, the replayed optimizer state goes with them, and a warning names the
largest difference. A version whose state was pruned (`run.keep_trainer_states`) is not deferred:
replay stops there and it loads as before (optimizer afresh, with a message).
"""

from __future__ import annotations

import os
import tempfile
import typing

import pandas as pd
from safetensors.torch import load_file

from engines.training.lora import plain_model
from tasks.run.common import TRAINER_STATE, config_of, fetch_cached, store_of
from tasks.run.keys import is_policy_of
from tasks.run.seeds import update_seed

if typing.TYPE_CHECKING:  # annotations only
    from configs.schema import TrainingConfig
    from engines.algorithms.config import AlgorithmConfig

DEFERRED = "trainer_state_deferred"  # manifest metadata of a version published without trainer_state.pt


def trainer_state_due(iteration: int, every: int, last: int, actor_kept: bool) -> bool:
    """Whether iteration `iteration`'s version holds trainer_state.pt: `every` (checkpoint.optimizer_every)
    divides it, it is the loop's `last`, or the training actor that holds the state in memory will
    not live on to train the next iteration (`actor_kept` False)."""
    return every <= 1 or iteration % every == 0 or iteration >= last or not actor_kept


def update_args(cfg, iteration: int) -> dict:
    """The per-iteration arguments of TrainWorker.update that `train` passes (and replay repeats)."""
    a = cfg.algorithm
    return {"temperature": cfg.rollout.temperature or 1.0, "seed": update_seed(cfg.run.seed, iteration),
            "train_actor": a.advantage != "gae" or iteration > a.critic_warmup_iterations}


def deferred_chain(store, run_id: str, key: str) -> tuple[str, list[tuple[int, str, str]]]:
    """(base, chain): `chain` = the deferred versions from the oldest after `base` up to `key`, each as
    (iteration, version key, rollout table key); `base` = the newest one before them that is not
    deferred (holds trainer_state.pt, was pruned, or is the run's starting policy). Only this run's
    own versions are followed (by their manifests' parents); ([], key) when `key` is not deferred."""
    chain = []
    while is_policy_of(run_id, key):
        m = store.manifest(key)
        if TRAINER_STATE in m.files or DEFERRED not in m.metadata:
            break
        chain.append((int(m.metadata["iteration"]), key, m.metadata["rollout_table"]))
        key = m.parents[0]
    return key, chain[::-1]


def published_weights(model_dir: str) -> dict:
    """The tensors of the safetensors files directly in `model_dir` (not its critic/)."""
    out = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, name)))
    return out


def max_abs_diff(got: dict, published: dict) -> float:
    """Largest |got - published| over the published tensors (inf when one is missing from `got` or
    has another shape)."""
    worst = 0.0
    for name, w in published.items():
        g = got.get(name)
        if g is None or g.shape != w.shape:
            return float("inf")
        worst = max(worst, float((g.detach().float().cpu() - w.float()).abs().max()) if w.numel() else 0.0)
    return worst


def replay(worker, spec, key: str, base: str, chain: list[tuple[int, str, str]], training: TrainingConfig,
           algorithm: AlgorithmConfig | None) -> str:
    """Rebuild deferred version `key` in TrainWorker `worker`: load `base`, run the update of each
    version in `chain` on its published rollout table, compare with `key`'s published weights.
    Returns what happened (TrainWorker.load's answer)."""
    from engines.training.critic_model import CRITIC_SUBDIR  # here, not at the top: it pulls in transformers' models (~1 s), which
                                                    # only a replay in the training actor needs, not the tasks importing this
    cfg, store = config_of(spec), store_of(spec)
    worker._load(spec, base, training, algorithm)
    for iteration, _version, table_key in chain:
        with tempfile.TemporaryDirectory() as d:  # hash-verified; not kept (fetch_cached keeps what it fetches)
            table = pd.read_parquet(os.path.join(store.fetch(table_key, d), "rollout.parquet"))
        worker.update(table, algorithm, training, **update_args(cfg, iteration))
    state = worker.trainer_state()
    weights = worker.engine.checkpoint_state_dict() or plain_model(worker.engine.model).state_dict()
    model_dir = fetch_cached(spec, key)  # weights, tokenizer, critic (a deferred version has no trainer state)
    diff = max_abs_diff(weights, published_weights(model_dir))
    if worker.critic_engine is not None:
        critic = worker.critic_engine.strategy.full_state_dict() or worker.critic_engine.critic.state_dict()
        diff = max(diff, max_abs_diff(critic, published_weights(os.path.join(model_dir, CRITIC_SUBDIR))))
    how = f"replayed {len(chain)} update(s) from {base}"
    if diff != 0.0:
        print(f"flyroll: replaying {key}'s trainer state from {base} gave weights that differ from the published "
              f"ones (max abs difference {diff:.3g}; another torch thread count or device changes the float "
              "rounding): training goes on from the published weights with the replayed optimizer and objective "
              "state", flush=True)
        worker._load(spec, key, training, algorithm, state=state)
        how += f", max abs weight difference {diff:.3g}: published weights kept"
    worker.key = key
    return how
