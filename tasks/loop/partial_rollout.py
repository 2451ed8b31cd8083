"""Partial rollout in the rollout task (`rollout.partial_rollout_max_split` N > 1): the pool of samples
carried from the previous iteration, the prompt stream, the generation actors, and the carry that
survives the task in the artifact store. The round bookkeeping is engines/generation/partial_rollout.py.

The carry of iteration i is a versioned artifact `runs/<run_id>/rollout_carry/iNNNN` (tasks/run/keys.py `carry_key`):
`carry.parquet` (the carried samples: the rollout columns plus `policy_versions` and
`stream_position`; nested prompt fields as JSON text) and `stream.json` ({"iteration", "next_position":
the prompt stream's next position}); first parent the policy that generated this iteration's segments.
Iteration i+1 reads it (i >= 1; a missing one is an error naming its key, never a fresh start), and a
rerun of iteration i (a resumed run) replaces it with what the rerun produced, so the next iteration
continues from exactly the samples the rerun's batch left out.
"""

from __future__ import annotations

import json
import os
import tempfile

import pandas as pd
import ray

from engines.data.datasets import decode_nested, encode_nested
from engines.generation.partial_rollout import partial_rollout
from infra.manifest import sha256_file
from tasks.run.common import config_of, execution_id, store_of
from tasks.run.keys import carry_key
from tasks.actors.pools import generate_groups, generate_sharded, rollout_sampling
from tasks.loop.prompts import stream_prompts
from tasks.run.types import PolicyRef, RunSpec
from tasks.run.seeds import rollout_seed, segment_seed

_LISTS = {"prompt_token_ids": int, "response_token_ids": int, "behaviour_logprobs": float, "policy_versions": int}


def read_carry(spec: RunSpec, iteration: int) -> tuple[list[dict], int]:
    """(samples carried into `iteration`, the prompt stream's position): nothing and 0 for the run's
    first iteration; else iteration-1's carry, which must exist."""
    if iteration <= 1:
        return [], 0
    store, key = store_of(spec), carry_key(spec, iteration - 1)
    if not store.exists(key):
        raise FileNotFoundError(
            f"partial rollout (rollout.partial_rollout_max_split={config_of(spec).rollout.partial_rollout_max_split}): "
            f"iteration {iteration} continues from the samples iteration {iteration - 1} carried, but {key!r} "
            f"({store.uri(key)}) is not in the store; expected the rollout task of iteration {iteration - 1} "
            "to have published it (rerun that iteration, or start the run afresh with --restart)")
    with tempfile.TemporaryDirectory() as d:  # not the fetch cache: a rerun replaces this version
        store.fetch(key, d)
        df = pd.read_parquet(os.path.join(d, "carry.parquet"))
        with open(os.path.join(d, "stream.json")) as f:
            position = int(json.load(f)["next_position"])
    if df.empty:
        return [], position
    rows = decode_nested(df).to_dict(orient="records")
    for r in rows:
        for col, kind in _LISTS.items():
            r[col] = [kind(x) for x in r[col]]
    return rows, position


def publish_carry(spec: RunSpec, rows: list[dict], position: int, policy: PolicyRef, iteration: int) -> str:
    """Publish iteration `iteration`'s carry (see the module docstring); a different one already there
    (an earlier attempt of this iteration) is replaced."""
    store, key = store_of(spec), carry_key(spec, iteration)
    with tempfile.TemporaryDirectory() as d:
        encode_nested(pd.DataFrame(rows)).to_parquet(os.path.join(d, "carry.parquet"), index=False)
        with open(os.path.join(d, "stream.json"), "w") as f:
            json.dump({"iteration": iteration, "next_position": position}, f, sort_keys=True)
        if store.exists(key):
            files = store.manifest(key).files
            if {n: sha256_file(os.path.join(d, n)) for n in os.listdir(d)} != {n: e.sha256 for n, e in files.items()}:
                store.delete(key)
        store.publish(d, key, kind="rollout_carry", producer="rollout", parents=[policy.key], execution_id=execution_id(),
                      metadata={"iteration": iteration, "next_position": position, "rows": len(rows),
                                "groups": len({r["stream_position"] for r in rows})})
    return key


def partial_batch(spec: RunSpec, workers: list, policy: PolicyRef, train: pd.DataFrame, iteration: int) -> tuple[pd.DataFrame, dict]:
    """(the rollout table of `iteration`, metrics): engines/generation/partial_rollout.py `partial_rollout` over
    the generation actors (serving `policy`), from iteration-1's carry; publishes this iteration's.
    Seeds: the rollout's seed (run seed, iteration) plus an offset per round and call."""
    cfg = config_of(spec)
    r = cfg.rollout
    seed = rollout_seed(cfg.run.seed, iteration)
    carry, position = read_carry(spec, iteration)

    def sample_new(prompts: pd.DataFrame, max_new_tokens: int, round_: int) -> list[list[dict]]:
        return generate_groups(spec, workers, prompts, policy.version, iteration, segment_seed(seed, round_),
                               max_new_tokens=max_new_tokens)

    def continue_(sequences: list[list[int]], max_new_tokens: int, round_: int) -> list[tuple]:
        params = rollout_sampling(cfg, segment_seed(seed, round_, continued=True, max_new_tokens=max_new_tokens), n=1,
                                  max_new_tokens=max_new_tokens)
        out = [c for _, completions in generate_sharded(workers, sequences, params)
               for c in sorted(completions, key=lambda c: c.prompt_index)]
        return [(c.token_ids, c.logprobs, c.finish_reason) for c in out]

    def decode(token_lists: list[list[int]]) -> list[str]:
        return ray.get(workers[0].decode.remote(token_lists)) if token_lists else []

    result = partial_rollout(
        carry, position, batch=r.prompts_per_iteration, group_size=r.samples_per_prompt, max_new_tokens=r.max_new_tokens,
        max_split=r.partial_rollout_max_split, version=policy.version,
        draw=lambda start, count: stream_prompts(train, start, count, cfg.run.seed),
        sample_new=sample_new, continue_=continue_, decode=decode, stop=tuple(r.stop))
    publish_carry(spec, result.carry, result.position, policy, iteration)
    df = encode_nested(pd.DataFrame(result.batch).drop(columns=["stream_position"]))
    return df, {**result.metrics, "rollout/partial_stream_position": float(result.position)}
