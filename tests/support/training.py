"""A scored rollout table, the columns the training path reads (tests/engines/training/test_strategies.py,
tests/engines/training/test_lora.py, tests/engines/models/test_devices.py), and whether a rank holds only part of a sharded parameter
(tests/engines/weight_sync/test_update_group.py, tests/tasks/loop/test_live_sync_sharded.py)."""

from __future__ import annotations


def _scored_table(model, tok, groups: int = 5, per_group: int = 3):
    """A scored rollout table (the columns training reads): fixed random tokens, rewards 0/1,
    old log-probs = the policy's own, ref = old minus noise."""
    import pandas as pd

    from tests.support.strategy_ranks import synthetic_batch

    n = groups * per_group
    batch, _, old, ref = synthetic_batch(tok, model, rows=n, seed=1)
    P = batch.prompt_width
    rows = []
    for i in range(n):
        p = batch.input_ids[i, :P][batch.attention_mask[i, :P].bool()].tolist()
        r = batch.responses[i][batch.response_mask[i].bool()].tolist()
        rows.append({"prompt_id": i // per_group, "group_id": f"g{i // per_group}", "prompt_token_ids": p,
                     "response_token_ids": r, "reward": float((i * 7) % 3 == 0), "finish_reason": "stop",
                     "old_logprobs": old[i, : len(r)].tolist(), "ref_logprobs": ref[i, : len(r)].tolist(),
                     "behaviour_logprobs": old[i, : len(r)].tolist(), "values": (0.1 * old[i, : len(r)]).tolist()})
    return pd.DataFrame(rows)


def is_half(p) -> bool:
    """Whether this rank holds less than the whole parameter: an FSDP2 DTensor's local shard, or a ZeRO-3
    partition beside the empty placeholder DeepSpeed leaves in the module (not one it keeps whole)."""
    if type(p).__name__ == "DTensor":
        return p.to_local().numel() < p.numel()
    return hasattr(p, "ds_tensor") and p.numel() == 0 and 0 < p.ds_tensor.numel() < p.ds_numel


def publish_step(store, files: dict[str, bytes], folder, key: str) -> None:
    """Publish the checkpoint files `TrainWorker.step` returned (relative path -> bytes) as `key`,
    written under `folder` first, as the training stage does with a rank's returned bytes."""
    from pathlib import Path

    for rel, data in files.items():
        path = Path(folder) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    store.publish(str(folder), key, kind="checkpoint", producer="test")
