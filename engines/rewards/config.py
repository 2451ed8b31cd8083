"""The `reward` section of the config, beside the code it configures (as engines/algorithms/config.py
is for `algorithm`): the routes and timeout of the reward functions, the model judge, the reward
model and the code sandbox. configs/schema.py embeds `RewardConfig`; the reward workers are handed it
whole (with the reward role's device and dtype, engines/rewards/models.py `RewardPlacement`) and read its
typed fields, never a dict by string key. The scoring path imports this module for annotations only, so it
runs where pydantic is not installed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JudgeConfig(_Section):
    model: str | None = Field(None, description="The judge (a domain routed to 'judge' in reward.functions): a Hugging Face causal-LM directory, a local path or an fsspec URL such as s3://bucket/judge (copied to a local folder once per reward worker; S3 endpoint and credentials from the AWS_* env vars). Required when a domain routes to 'judge'. It runs inside the reward workers on placement.reward.device / dtype (cpu and float32 unless the reward role is given a GPU: the profiles request none for it), so keep it small.")
    rubric: str | None = Field(None, description="str.format template of the judge prompt with {prompt}, {response} and optionally {reference} / {reference_block} (the sample's answer). None = engines/rewards/judge.py DEFAULT_RUBRIC, which asks for 'Score: N/10'.")
    scale: float = Field(10.0, gt=0, description="Top of the judge's rating scale when the output has no denominator ('Score: 7' -> 7/scale). Match it to the rubric.")
    max_new_tokens: int = Field(32, ge=1, le=4096, description="Tokens the judge may generate (greedy). Enough for the verdict; longer = slower and more room to ramble past it.")
    max_prompt_tokens: int | None = Field(1024, ge=16, description="Rubric prompt length cap in tokens, cut from the left (the end holds the response and the verdict instruction). None = no cap.")
    apply_chat_template: bool | None = Field(None, description="Wrap the rubric with the judge tokenizer's chat template. None = when the tokenizer has one.")
    batch_size: int = Field(16, ge=1, le=4096, description="Samples per judge generate call. Each call is one unit of isolation: it has its own timeout, and a timeout costs all of its samples.")
    timeout_s: float = Field(300.0, gt=0, le=86_400, description="Timeout of one judge call (batch_size samples). Past it the call's samples score 0, are flagged, and the reward worker is replaced after its batch.")
    load_timeout_s: float = Field(600.0, gt=0, le=86_400, description="Timeout for loading the judge (download + build), once per reward worker. A load that fails or times out flags every sample routed to the judge.")

    @model_validator(mode="after")
    def _check(self) -> "JudgeConfig":
        if self.rubric is not None:
            try:
                rendered = self.rubric.format(prompt="", response="\0", reference="", reference_block="")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"reward.judge.rubric: not a usable str.format template ({type(e).__name__}: {e}); "
                                 "expected only the placeholders {prompt}, {response}, {reference}, {reference_block} "
                                 "(write a literal brace as {{ or }})") from None
            if "\0" not in rendered:
                raise ValueError("reward.judge.rubric: has no {response} placeholder; the judge would not see the response")
        return self


class RewardModelConfig(_Section):
    model: str | None = Field(None, description="The reward model (a domain routed to 'reward_model' in reward.functions): any Hugging Face AutoModelForSequenceClassification directory, a local path or an fsspec URL such as s3://bucket/rm (copied to a local folder once per reward worker; S3 endpoint and credentials from the AWS_* env vars). Required when a domain routes to 'reward_model'. It runs inside the reward workers on placement.reward.device / dtype (cpu and float32 unless the reward role is given a GPU).")
    batch_size: int = Field(8, ge=1, le=4096, description="Samples per forward pass. Each batch is one unit of isolation (own timeout); larger = faster, more memory.")
    normalize: Literal["none", "sigmoid", "affine"] = Field("none", description="Reward from the logit: 'none' = the raw logit (InstructGPT-style RM), 'sigmoid' = sigmoid(logit) in (0, 1), 'affine' = (logit - shift) / scale. Raw logits are unbounded, so with reward_norm off prefer 'sigmoid' or 'affine'.")
    shift: float = Field(0.0, description="normalize='affine': subtracted from the logit (e.g. the RM's mean score).")
    scale: float = Field(1.0, description="normalize='affine': the logit minus shift is divided by it (e.g. the RM's score std). Must not be 0.")
    label_index: int = Field(0, ge=0, description="Which logit is the score (0 for the usual num_labels=1 reward model; e.g. the 'good' class of a classifier).")
    max_length: int | None = Field(2048, ge=8, description="Truncate prompt + response to this many tokens (right side cut). None = no truncation (the model's context must hold it).")
    apply_chat_template: bool | None = Field(None, description="Score the tokenizer's chat template over [user: prompt, assistant: response]. None = when the tokenizer has one; else the text is prompt + response.")
    timeout_s: float = Field(120.0, gt=0, le=86_400, description="Timeout of one batch forward. Past it the batch's samples score 0, are flagged, and the reward worker is replaced after its batch.")
    load_timeout_s: float = Field(600.0, gt=0, le=86_400, description="Timeout for loading the reward model (download + build), once per reward worker. A load that fails or times out flags every sample routed to it.")

    @model_validator(mode="after")
    def _check(self) -> "RewardModelConfig":
        if self.normalize == "affine" and self.scale == 0:
            raise ValueError("reward.reward_model.scale: 0 with normalize='affine' (the logit is divided by it); expected a non-zero number")
        return self


class SandboxConfig(_Section):
    """The code sandbox's isolation and work-dir budget (engines/sandbox/runner.py, docs/sandbox.md)."""

    allow_weaker: Literal["namespaces", "rlimits-only"] | None = Field(None, description="Without bubblewrap the code reward refuses to run model code (the scoring fails with the reason and the fix) unless a weaker mode is allowed here by name: 'namespaces' (util-linux unshare: network/PID/mount namespaces, uid drop as root; the host filesystem stays writable where the sandbox uid may write) or 'rlimits-only' (also no namespaces: rlimits and the audit hook only). The metric reward/<domain>/isolation_<mode> counts the samples each mode scored.")
    max_disk_mb: int = Field(256, ge=1, le=65_536, description="Size of the per-run work dir (a tmpfs inside the sandbox: memory, not host disk): past it writes fail with ENOSPC and the verdict is 'disk'.")
    max_files: int = Field(10_000, ge=1, le=10_000_000, description="Files and directories a run may create in its work dir (the tmpfs's inode count as root; otherwise counted): past it the verdict is 'disk'.")


class RewardConfig(_Section):
    functions: dict[str, str] = Field(default_factory=dict, description="Route a domain to a reward function: {domain: registered name or 'package.module:function'}. Unlisted domains use the function registered under the domain's own name. A function is `fn(response: str, sample: dict) -> float`, so adding one is one file. Two names route to a model instead, set up below: 'judge' (reward.judge) and 'reward_model' (reward.reward_model).")
    timeout_s: float = Field(5.0, gt=0, le=3600, description="Per-call reward timeout. Every reward-function call runs in a worker process (engines/rewards/calls.py); past this its process is killed, the sample scores 0 and reward_error names the function. A reward that raises does the same. (The model rewards have their own per-batch timeouts.)")
    budget_s: float = Field(600.0, gt=0, le=86_400, description="Wall-clock budget of one batch of reward-function calls (one reward worker's share of a scoring call): past it the calls still running are killed and those not started are not run, each scoring 0 with an error naming reward.budget_s. Scoring a batch never takes longer.")
    processes: int = Field(2, ge=1, le=256, description="Worker processes per reward worker that run reward-function calls in parallel (each call in one process, so a hang can be ended by killing it).")
    max_abs: float = Field(1e6, gt=0, description="A reward must be a finite number with |reward| <= max_abs; inf, NaN, a larger value, a string or None is the sample's error, not a score (1e30 would overflow the advantage's statistics).")
    bounds: dict[str, tuple[float, float]] = Field(default_factory=dict, description="Declared reward range per domain, {domain: [low, high]} (inclusive): a reward outside it is the sample's error. Unlisted domains are bounded by max_abs only.")
    max_error_rate: float = Field(0.5, ge=0, le=1, description="A domain whose reward fails (raises, times out, returns a non-number, crashes its process) on more than this share of a scored batch's rows fails the run, naming the reward function, the domain and one example error -- in training's scoring and in evaluation. 1 = never fail on reward errors (they are still counted in reward/<domain>/errors).")
    num_workers: int = Field(1, ge=1, le=256, description="Reward worker actors. Each one loads its own judge / reward model once, so more workers = more memory.")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="The model judge (LLM-as-a-judge, MT-Bench arXiv 2306.05685) for domains routed to 'judge': a rubric prompt, greedy decoding, the rating parsed to [0, 1]; an unparsable verdict scores 0 and is flagged.")
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig, description="The reward model (InstructGPT, arXiv 2203.02155) for domains routed to 'reward_model': a sequence-classification model scores prompt + response in batches.")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="The code sandbox (engines/sandbox/runner.py): bubblewrap required unless allow_weaker names a weaker mode; the work dir's size and file budget.")

    @model_validator(mode="after")
    def _check(self) -> "RewardConfig":
        for domain, (low, high) in self.bounds.items():
            if not low <= high:
                raise ValueError(f"reward.bounds.{domain}: [{low}, {high}] is empty; expected [low, high] with low <= high")
        return self
