"""FlyrollConfig's cross-section checks (its validator calls `check_config`): settings that are each
valid but do not work together, RLVR-only options an agentic run would ignore, and what the data
section says about the train split before it is built. Each refusal (ValueError) names the field,
the value and what to set instead. The section classes live in configs/schema.py; these take the
config as built there."""

from __future__ import annotations

from configs.hand_off import check_hand_off
from engines.algorithms.registry import ADVANTAGES, GROUP_BASELINE


def check_config(cfg) -> None:
    """Refuse (ValueError, naming the fields) settings that are each valid but do not work together."""
    from engines.data.synthetic import DOMAINS

    check_hand_off(cfg)
    split = cfg.rollout.partial_rollout_max_split
    if split > 1:
        refused = [name for name, on in (
            ("env (the agentic workflow)", cfg.env is not None),
            ("algorithm.filter_groups (dynamic sampling)", cfg.algorithm.filter_groups),
            ("rollout.score_while_generating (the rollout scheduler)", cfg.rollout.score_while_generating),
            (f"pipeline.off_policy_steps={cfg.pipeline.off_policy_steps}", cfg.pipeline.off_policy_steps > 0),
            ("data.domain_weights (per-batch domain quotas)", bool(cfg.data.domain_weights))) if on]
        if refused:
            raise ValueError(f"rollout.partial_rollout_max_split={split} is built for the plain synchronous RLVR "
                             f"rollout; it does not handle {', '.join(refused)}: unset that, or set "
                             "rollout.partial_rollout_max_split: 1")
        if cfg.algorithm.tis_cap is None:
            raise ValueError(f"rollout.partial_rollout_max_split={split} carries unfinished samples into the next "
                             "iteration, where a newer policy continues them (their earlier tokens are off-policy); "
                             "set algorithm.tis_cap (e.g. 2.0) so the update corrects them with truncated "
                             "importance sampling")
    if cfg.rollout.score_while_generating and cfg.env is not None:
        raise ValueError("rollout.score_while_generating is built for workflows/rlvr.py; the agentic workflow (env set) "
                         "scores each episode's steps in the environment: set it false")
    if cfg.model.warm_start.steps and (cfg.env is None or cfg.model.path is None):
        raise ValueError(f"model.warm_start.steps={cfg.model.warm_start.steps} fine-tunes model.path on an environment's "
                         "solver episodes: it needs env set and model.path set (the tiny policy, path unset, is "
                         "pre-trained on them by model.bootstrap); set model.warm_start.steps: 0")
    if cfg.env is not None:
        check_agentic(cfg)
    if cfg.loop.fuse > 1 and cfg.env is not None:
        raise ValueError(f"loop.fuse={cfg.loop.fuse}: fused iterations are built for workflows/rlvr.py; "
                         "the agentic workflow (env set) runs each stage as its own task: set loop.fuse: 1")
    if cfg.training.num_workers > 1 and cfg.training.strategy == "torch":
        raise ValueError(f"training.num_workers={cfg.training.num_workers}: strategy 'torch' is one process; choose a distributed training.strategy (ddp, fsdp2, deepspeed_zero2, deepspeed_zero3) or num_workers 1")
    if cfg.training.compile and cfg.training.strategy != "torch":
        raise ValueError(f"training.compile is only built for strategy 'torch' (one process); with "
                         f"{cfg.training.strategy!r} set training.compile: false")
    if cfg.training.lora.rank and cfg.training.strategy not in ("torch", "ddp"):
        raise ValueError(f"training.lora.rank={cfg.training.lora.rank} is built for strategies 'torch' and 'ddp' only; "
                         f"with {cfg.training.strategy!r} set training.lora.rank: 0")
    if cfg.training.lora.rank:
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise ValueError(f"training.lora.rank={cfg.training.lora.rank} needs peft, which is not installed: pip install 'flyroll[lora]'")
    if cfg.training.strategy.startswith("deepspeed"):
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise ValueError(f"training.strategy={cfg.training.strategy!r} needs DeepSpeed, which is not installed: pip install 'flyroll[deepspeed]'")
        from engines.training.strategies import check_zero_optimization

        check_zero_optimization(cfg.training.zero_optimization)
    elif cfg.training.zero_optimization:
        raise ValueError(f"training.zero_optimization={cfg.training.zero_optimization} is for the deepspeed strategies; "
                         f"training.strategy is {cfg.training.strategy!r}: remove it or choose deepspeed_zero2/3")

    bad = [d for d in cfg.data.domains if d not in DOMAINS]
    if bad:
        raise ValueError(f"data.domains: unknown domain(s) {bad}; expected a subset of {list(DOMAINS)}")
    if cfg.env is not None:
        from engines.agentic.envs import ENVIRONMENTS, make_env

        if cfg.env.name not in ENVIRONMENTS:
            raise ValueError(f"env.name: unknown environment {cfg.env.name!r}; expected one of {sorted(ENVIRONMENTS)}")
        try:  # a misspelt or out-of-range option fails here, not after the model import and warm start
            make_env(cfg.env.name, **cfg.env.kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"env.kwargs: {cfg.env.name!r} refuses {cfg.env.kwargs}: {e}") from None
    for i, src in enumerate(cfg.data.sources):
        if src.kind == "file" and not src.uri:
            raise ValueError(f"data.sources[{i}]: kind 'file' needs `uri` (a .jsonl or .parquet table)")
        if src.kind == "reasoning_gym" and not src.names:
            raise ValueError(f"data.sources[{i}]: kind 'reasoning_gym' needs `names` (generator names)")
    for name, section in (("judge", cfg.reward.judge), ("reward_model", cfg.reward.reward_model)):
        routed = sorted({d for d, fn in cfg.reward.functions.items() if fn == name}
                        | {s.domain for s in cfg.data.sources if s.domain == name and name not in cfg.reward.functions})
        if routed and not section.model:
            raise ValueError(f"reward.{name}.model: domain(s) {routed} route to {name!r} (reward.functions) but "
                             f"reward.{name}.model is not set; expected a Hugging Face model directory "
                             "(a local path or an s3:// URI)")
    negative = {k: v for k, v in cfg.data.domain_weights.items() if v < 0}
    if negative or (cfg.data.domain_weights and sum(cfg.data.domain_weights.values()) <= 0):
        raise ValueError(f"data.domain_weights: weights must be >= 0 and sum to > 0, got {dict(cfg.data.domain_weights)}")
    if cfg.algorithm.advantage in GROUP_BASELINE and cfg.rollout.samples_per_prompt < 2:
        raise ValueError(f"rollout.samples_per_prompt={cfg.rollout.samples_per_prompt}: advantage "
                         f"'{cfg.algorithm.advantage}' compares samples within a group (its baseline is the group's "
                         "own rewards), so with one sample per prompt every advantage is 0 and nothing trains; "
                         f"expected at least 2 samples per prompt, or an estimator without a group baseline "
                         f"({sorted(set(ADVANTAGES) - GROUP_BASELINE)})")
    if cfg.algorithm.advantage == "on_policy_distill" and not cfg.model.reference_path:
        raise ValueError("algorithm.advantage 'on_policy_distill' scores each sampled token by its log-prob under the "
                         "teacher, which is the reference model: set model.reference_path to the teacher (a model "
                         "folder, 'package:NAME' or any run's published version; it must share the policy's tokenizer)")
    if cfg.env is None:
        check_data_size(cfg)


def check_agentic(cfg) -> None:
    """Refuse the RLVR-only options an agentic run (env set) would otherwise ignore: its rollout
    (tasks/stages/agentic.py) plays B seeds x G episodes once, with no rollout scheduler to drop and refill
    groups, no data split and no reward workers (the reward is the environment's return)."""
    a = cfg.algorithm
    refused = [(name, why) for name, on, why in (
        ("algorithm.filter_groups", a.filter_groups and not cfg.env.workers, ("dynamic sampling (drop "
         "all-equal groups and refill) is built for the asynchronous manager only: set env.workers > 0")),
        ("algorithm.mask_truncated", a.mask_truncated, ("it masks finish_reason 'length'; an episode cut by "
         "env.max_context_tokens ends 'truncated' and would never be masked")),
        ("rollout.chunk_prompts", cfg.rollout.chunk_prompts is not None, ("it sizes the RLVR rollout scheduler's "
         "requests; the agentic rollout shards seeds over the generation workers")),
        ("loop.eval_samples", cfg.loop.eval_samples > 0, ("agentic evaluation samples with env.eval_temperature "
         "and env.eval_samples_per_seed")),
        ("placement.offload_generation", cfg.placement.offload_generation != "none", ("the agentic rollout "
         "(tasks/stages/agentic.py) keeps its generation engines awake")),
    ) if on]
    for model, why in ((cfg.data, "episodes start from env seeds, not a data split"),
                       (cfg.reward, "no reward workers start: the reward is the environment's return")):
        section, default = "data" if model is cfg.data else "reward", type(model)()
        refused += [(f"{section}.{k}", why) for k in type(model).model_fields if getattr(model, k) != getattr(default, k)]
    if not cfg.env.workers:
        default = type(cfg.env)(name=cfg.env.name)
        refused += [(f"env.{k}", "it configures the env worker pool or the asynchronous manager, which env.workers: 0 "
                     "does not start")
                    for k in ("worker_cpus", "worker_memory", "worker_concurrency", "step_timeout_s", "max_retries",
                              "extra_groups")
                    if getattr(cfg.env, k) != getattr(default, k)]
    if refused:
        raise ValueError("the agentic workflow (env set) does not use " + "; ".join(f"{n} ({why})" for n, why in refused)
                         + ": leave those at their defaults")


def check_data_size(cfg) -> None:
    """What the data section says about the train split before it is built: the domains it holds
    (against domain_weights) and its rows (against one batch). Sources whose domains or sizes only
    the data tells (a file) are checked when the dataset is built (tasks/stages/prepare.py make_dataset)."""
    d, batch = cfg.data, cfg.rollout.prompts_per_iteration
    held = data_domains(d)
    absent = sorted(set(d.domain_weights) - held) if held is not None else []
    if absent:
        raise ValueError(f"data.domain_weights: domain(s) {absent} (weights {[d.domain_weights[k] for k in absent]}) "
                         f"are not in the data, which holds {sorted(held)}; expected a weight per domain of "
                         "data.sources (its `domain`, else the source's own) or data.domains")
    rows = train_rows(d)
    if rows is not None and rows < batch and cfg.rollout.partial_rollout_max_split == 1:
        raise ValueError(f"data.train_size={d.train_size}: the train split has {rows} prompts, fewer than one batch "
                         f"(rollout.prompts_per_iteration={batch}); a batch would hold a prompt twice and its groups "
                         f"would merge into one (same group_id); expected at least {batch} train prompts")


_SOURCE_DOMAIN = {"reasoning_gym": "reasoning_gym", "humaneval": "code", "ifeval": "ifeval"}  # engines/data/sources.py defaults


def data_domains(d) -> set[str] | None:
    """The domains the train split will hold, or None when only the data can tell (a file source
    without `domain`)."""
    if not d.sources:
        return set(d.domains)
    held: set[str] = set()
    for src in d.sources:
        if src.domain:
            held.add(src.domain)
        elif src.kind == "synthetic":
            held |= set(src.names or d.domains)
        elif src.kind in _SOURCE_DOMAIN:
            held.add(_SOURCE_DOMAIN[src.kind])
        else:
            return None
    return held


def train_rows(d) -> int | None:
    """Prompts in the train split, or None when only the data can tell (a file, HumanEval's fixed set)."""
    if not d.sources:
        return d.train_size
    if any(src.kind not in ("synthetic", "reasoning_gym", "ifeval") for src in d.sources):
        return None
    return sum(src.train_size or d.train_size for src in d.sources)


# --- which workflow a config belongs to (workflows/rlvr.py and agentic.py, sft.py, dpo.py) -------------
KINDS = ("sft", "dpo", "distill")
ON_POLICY_DISTILL = "on_policy_distill"   # an RL run whose advantage is the reverse KL to its reference, the teacher


def tagged_kind(cfg, kind: str) -> str:
    """The kind a run of workflow `kind` is tagged and published with: `kind`, except that an RL run
    with advantage on_policy_distill is "on_policy_distill" (from workflows/rlvr.py, agentic.py or
    distill.py `distill_on_policy` alike)."""
    return ON_POLICY_DISTILL if kind in ("rl", ON_POLICY_DISTILL) and cfg.algorithm.advantage == ON_POLICY_DISTILL else kind


def kind_of(cfg) -> str:
    """"sft", "dpo" or "distill" (the section the config sets), else "rl"."""
    return next((k for k in KINDS if getattr(cfg, k) is not None), "rl")


def check_kind(cfg, kind: str) -> None:
    """Refuse a config for another workflow (`kind` "rl", "on_policy_distill", "sft", "dpo" or "distill"): an RL run with
    an sft, dpo or distill section; a run of one of those kinds without its section, with another
    kind's section too, with `env`, or with RL-only settings (`rl_only_settings`)."""
    sections = [s for s in KINDS if getattr(cfg, s) is not None]
    if kind == ON_POLICY_DISTILL:   # workflows/distill.py distill_on_policy: the RL loop with the teacher as reference
        if cfg.algorithm.advantage != ON_POLICY_DISTILL:
            raise ValueError(f"distill_on_policy runs the RL loop with algorithm.advantage 'on_policy_distill' and the "
                             f"teacher as model.reference_path; this config sets algorithm.advantage "
                             f"{cfg.algorithm.advantage!r} (configs/distill_on_policy_tiny.yaml is an example)")
        kind = "rl"
    if kind == "rl":
        if sections:
            raise ValueError(f"this config sets the {sections[0]} section: it is a {sections[0].upper()} run; start it with "
                             f"`pyflyte run workflows/{sections[0]}.py {sections[0]}`, or remove the section for RL")
        return
    if kind not in KINDS:
        raise ValueError(f"unknown run kind {kind!r}; expected one of {['rl', *KINDS]}")
    if getattr(cfg, kind) is None:
        raise ValueError(f"workflows/{kind}.py needs the config's {kind} section (its data: {kind}.train_uri); this config "
                         f"has none (docs/post-training.md)")
    if len(sections) > 1:
        raise ValueError(f"the config sets both {sections}: one run is one kind; chain them instead (model.path = the "
                         "first run's final policy)")
    if cfg.env is not None:
        raise ValueError(f"env is set: the environment belongs to workflows/agentic.py, not to a {kind.upper()} run")
    unused = rl_only_settings(cfg)
    if unused:
        raise ValueError(f"a {kind.upper()} run does not use the RL setting(s) {', '.join(unused)}: remove them from the "
                         f"config (the schedule is {kind}.batch_size, {kind}.steps or {kind}.epochs; docs/post-training.md)")


# what an SFT or DPO run reads of the RL sections: the evaluation's generation (rollout.max_new_tokens, stop,
# temperature, engine, workers), loop.eval_samples, data.max_line_bytes; the rest of these is RL's alone
_RL_ONLY = {"algorithm": None, "pipeline": None, "sync": None, "checkpoint": None,
            "loop": {"iterations", "eval_every", "fuse"}, "training": {"mini_batch_size"},
            "rollout": {"prompts_per_iteration", "samples_per_prompt", "score_while_generating", "chunk_prompts",
                        "partial_rollout_max_split"},
            "data": {"source", "domains", "train_size", "eval_size", "sources", "domain_weights", "max_prompt_tokens",
                     "over_length"}}


# ... and what DPO from on-policy pairs reads besides: the prompts and the size of a round
_ON_POLICY = {"data": None, "rollout": {"prompts_per_iteration", "samples_per_prompt"}}


def rl_only_settings(cfg) -> list[str]:
    """The settings of `cfg` that differ from the schema's defaults and only an RL run reads, dotted
    (DPO with dpo.pairs=on_policy reads the `data` section and the round's size too)."""
    given = cfg.model_dump(mode="json", exclude_defaults=True)
    on_policy = cfg.dpo is not None and cfg.dpo.pairs == "on_policy"
    out = []
    for sec, keys in _RL_ONLY.items():
        allowed = _ON_POLICY.get(sec, set()) if on_policy else set()
        for key in sorted(given.get(sec) or {}):
            if (keys is None or key in keys) and not (allowed is None or key in allowed):
                out.append(f"{sec}.{key}")
    return out
