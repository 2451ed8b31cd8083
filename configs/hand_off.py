"""The config's checks of how a new policy reaches the generators (FlyrollConfig's validator calls
`check_hand_off`): asynchronous generation, `sync` (live weight sync and its transport),
`placement.offload_generation` / `offload_train` / `offload_reference` / `hybrid` and `checkpoint.publish_every`. Each refusal names the field and why."""

from __future__ import annotations

import os


def check_hand_off(cfg) -> None:
    """Refuse (ValueError) a combination of pipeline, sync, offload and publish settings that cannot work."""
    if cfg.pipeline.off_policy_steps > 0:
        if cfg.algorithm.tis_cap is None:
            raise ValueError(f"pipeline.off_policy_steps={cfg.pipeline.off_policy_steps} samples with a policy "
                             f"{cfg.pipeline.off_policy_steps} update(s) old; set algorithm.tis_cap (e.g. 2.0) so "
                             "the update corrects it with truncated importance sampling")
    if cfg.sync.method == "live":
        live_sync_check(cfg.loop.fuse, cfg.pipeline.off_policy_steps)
    elif cfg.sync.transport != "broadcast":
        raise ValueError(f"sync.transport={cfg.sync.transport} moves the weights of a live sync; with "
                         f"sync.method={cfg.sync.method} the generators load each version from the store, so it "
                         "would do nothing: set sync.method: live, or leave sync.transport at broadcast")
    if (cfg.placement.offload_generation != "none" and cfg.loop.fuse == 1
            and os.environ.get("FLYROLL_RAY", "shared") == "per-task"):
        raise ValueError(f"placement.offload_generation={cfg.placement.offload_generation!r} with FLYROLL_RAY=per-task "
                         "and loop.fuse=1: each stage has its own Ray cluster, so the generation actors end with the "
                         "rollout task and share no memory with the trainer; set offload_generation: none, or "
                         "loop.fuse > 1 (one cluster for the fused iterations)")
    offload_check(cfg)
    if cfg.placement.hybrid:
        hybrid_check(cfg)
    if cfg.checkpoint.publish_every > 1:
        publish_every_check(cfg)


def offload_check(cfg) -> None:
    """placement.offload_train / offload_reference: refused where the actors do not outlive their task,
    or (offload_train) where the optimizer state is sharded."""
    p, per_task = cfg.placement, cfg.loop.fuse == 1 and os.environ.get("FLYROLL_RAY", "shared") == "per-task"
    for field, on, role in (("offload_train", p.offload_train != "none", "training"),
                            ("offload_reference", p.offload_reference, "reference")):
        if on and per_task:
            raise ValueError(f"placement.{field}={getattr(p, field)!r} with FLYROLL_RAY=per-task and loop.fuse=1: each "
                             f"stage has its own Ray cluster, so the {role} actors end with their task and share no memory "
                             f"with the others; set {field} to its default, or loop.fuse > 1 (one cluster for the fused iterations)")
    if p.offload_train != "none" and cfg.training.strategy != "torch":
        raise ValueError(f"placement.offload_train={p.offload_train!r} with training.strategy={cfg.training.strategy}: "
                         "offloading handles one process's plain tensors, not sharded (DTensor / DeepSpeed) optimizer "
                         "state; set offload_train: none, or training.strategy: torch")


def hybrid_check(cfg) -> None:
    """placement.hybrid (tasks/actors/hybrid.py): refused where its processes cannot host the roles as asked."""
    if cfg.rollout.engine != "hf":
        raise ValueError(f"placement.hybrid=true with rollout.engine={cfg.rollout.engine}: a hybrid worker hosts the hf "
                         "engine (vLLM inside the trainer's process is not built); set rollout.engine: hf, or hybrid: false")
    if cfg.rollout.num_workers != cfg.training.num_workers:
        raise ValueError(f"placement.hybrid=true with rollout.num_workers={cfg.rollout.num_workers} and "
                         f"training.num_workers={cfg.training.num_workers}: each hybrid worker hosts one training rank and "
                         "one generation engine; set the two counts equal, or hybrid: false")
    if cfg.loop.fuse == 1 and os.environ.get("FLYROLL_RAY", "shared") == "per-task":
        raise ValueError("placement.hybrid=true with FLYROLL_RAY=per-task and loop.fuse=1: each stage has its own Ray "
                         "cluster, so a hybrid worker would end with its task and host one role only; set hybrid: false, "
                         "or loop.fuse > 1 (one cluster for the fused iterations)")
    fields = type(cfg.sync).model_fields  # set = not the default (a to_json round trip marks every field given)
    given = sorted(f for f in ("transport", "bucket_mb", "timeout_s") if getattr(cfg.sync, f) != fields[f].default)
    if cfg.sync.method == "live" and given:
        raise ValueError(f"placement.hybrid=true copies a live sync's weights inside each hybrid worker (no update group), "
                         f"so {', '.join('sync.' + f for f in given)} would do nothing; leave "
                         f"{'them' if len(given) > 1 else 'it'} unset, or set hybrid: false")


def publish_every_check(cfg) -> None:
    """checkpoint.publish_every > 1: refused where a skipped version would be read from the store."""
    n, a = cfg.checkpoint.publish_every, cfg.algorithm
    rows = cfg.rollout.prompts_per_iteration * cfg.rollout.samples_per_prompt
    why = [text for text, on in (
        (f"sync.method={cfg.sync.method!r}: the generators load each version from the store; set sync.method: live "
         "(they then take the weights from the trainer)", cfg.sync.method != "live"),
        (f"checkpoint.optimizer_every={cfg.checkpoint.optimizer_every}: with publish_every every published version holds "
         "trainer_state.pt already; set checkpoint.optimizer_every: 1", cfg.checkpoint.optimizer_every > 1),
        ("env set (the agentic workflow): publish_every is built for workflows/rlvr.py", cfg.env is not None),
        ("loop.fuse=1: publish_every is built for fused iterations (loop.fuse > 1), where each task's last iteration is "
         "published whatever the loop's length (a retrain runs its own number of iterations); set loop.fuse > 1",
         cfg.loop.fuse <= 1),
        ("algorithm.advantage=gae: the reference stage loads the critic of the version it starts from out of the store",
         a.advantage == "gae"),
        (f"π_old is recomputed by the reference stage from the version the update starts from, out of the store "
         f"(algorithm.old_logprobs={a.old_logprobs!r}, ppo_epochs={a.ppo_epochs}, a rollout batch of {rows} rows "
         f"against training.mini_batch_size={cfg.training.mini_batch_size}, use_kl_loss={a.use_kl_loss}); take it from "
         "the update's own forward: old_logprobs auto with ppo_epochs 1, use_kl_loss true (or kl_coef 0) and "
         "mini_batch_size >= the rollout batch, or old_logprobs behaviour",
         a.old_logprobs != "behaviour" and not a.old_logprobs_in_update(rows, cfg.training.mini_batch_size))) if on]
    if why:
        raise ValueError(f"checkpoint.publish_every={n} skips the store upload of most versions, which only works "
                         "where nothing reads them from the store: " + "; ".join(why))


def live_sync_check(fuse: int, off_policy_steps: int) -> None:
    """sync.method=live: refused where trainer and generators are not alive together (per-task mode)."""
    if fuse == 1 and os.environ.get("FLYROLL_RAY", "shared") == "per-task":
        raise ValueError("sync.method=live with FLYROLL_RAY=per-task and loop.fuse=1: in per-task mode (one Ray cluster "
                         "per stage) the store is the hand-off, because the training cluster is gone when the rollout "
                         "starts; set sync.method: store, or loop.fuse > 1 (one cluster for the fused iterations)")
    if off_policy_steps > 0:
        raise ValueError(f"sync.method=live with pipeline.off_policy_steps={off_policy_steps}: the generators serve a "
                         "policy older than the one just trained (each rollout loads its own version from the store); "
                         "set sync.method: store, or pipeline.off_policy_steps: 0")
