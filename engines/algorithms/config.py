"""The RL algorithm section of the config: which advantage estimator, policy loss, KL estimator,
normalisations and masks to use, and their hyper-parameters.

Every name is checked against the registries in ``engines.algorithms.registry`` when the config
is loaded, so a typo fails before any cluster starts. The defaults are GRPO with PPO clipping
and a k3 KL loss (DeepSeekMath, arXiv 2402.03300); see docs/algorithms.md for every option.
"""

from __future__ import annotations

import inspect
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engines.algorithms import registry

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _check_name(field: str, value: str, table: dict) -> str:
    if value not in table:
        raise ValueError(f"algorithm.{field} = {value!r} is not registered; allowed: {sorted(table)}")
    return value


class AlgorithmConfig(BaseModel):
    """RL objective: advantages, policy/critic loss, KL, entropy, normalisation, masks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- advantages -------------------------------------------------------------------------
    advantage: str = Field(
        "grpo",
        description="Advantage estimator by registered name: grpo (group-normalised, DeepSeekMath "
        "2402.03300), rloo (leave-one-out, 2402.14740), reinforce (scalar batch/EMA baseline), "
        "reinforce_plus_plus (batch-whitened returns, 2501.03262), reinforce_plus_plus_baseline "
        "(group mean then batch whitening), gae (needs a critic; 1506.02438), on_policy_distill (each "
        "sampled token's advantage is minus its reverse KL to the teacher = model.reference_path, "
        "summed ahead with gamma; docs/post-training.md). Group estimators need several samples per "
        "prompt; gae costs a critic model.",
    )
    distill_reward_weight: float = Field(
        0.0, ge=0.0, le=100.0,
        description="advantage on_policy_distill only: weight w of the task reward mixed into the "
        "distillation advantage, w·(reward − the batch's mean reward) on every token of a sample. 0 = "
        "the teacher alone (the scoring stage still runs and its reward is logged).",
    )
    norm_adv_by_std: bool = Field(
        True,
        description="grpo and gigpo (both of its levels): divide by the group's reward std. False is "
        "Dr.GRPO (2503.20783), which removes the bias towards too-easy/too-hard prompts at the cost of a "
        "scale that depends on the reward range; it also keeps a small return difference small (an "
        "invalid-action penalty between two failed episodes is not scaled up to a success's weight).",
    )
    gamma: float = Field(
        1.0, ge=0.0, le=1.0,
        description="Per-token discount for gae, reinforce and reinforce_plus_plus; for gigpo, the discount "
        "across turns of the step-level returns. 1.0 is standard for outcome rewards; lower values favour "
        "early tokens (turns) and shorten the credit horizon. With gigpo at 1.0 a turn that leaves the "
        "state unchanged (a move into a wall) has the same step return as the move that follows it; "
        "GiGPO's paper uses 0.95.",
    )
    lam: float = Field(
        1.0, ge=0.0, le=1.0,
        description="GAE λ (Schulman et al. 2016): 1.0 = Monte-Carlo returns (low bias, high "
        "variance), lower values lean on the critic (less variance, more bias). gae only.",
    )
    reinforce_baseline: Literal["batch", "ema"] = Field(
        "batch",
        description="reinforce only: baseline = this batch's mean score, or an exponential moving "
        "average over batches (state kept by the trainer). EMA excludes the current sample's "
        "influence but lags a changing policy.",
    )
    reinforce_ema_decay: float = Field(
        0.9, ge=0.0, lt=1.0,
        description="reinforce with reinforce_baseline='ema': weight of the old baseline; higher = "
        "smoother but slower to follow the policy.",
    )
    whiten_advantages: bool = Field(
        False,
        description="Whiten advantages over the batch (zero mean, unit variance) after the "
        "estimator. Stabilises the step size; gae and the reinforce_plus_plus estimators already "
        "whiten, so leave it off for them.",
    )
    adv_clip: float | None = Field(
        None, gt=0.0,
        description="Clamp advantages to [-adv_clip, adv_clip] (None = off). Bounds the effect of "
        "outlier rewards at the cost of a biased gradient.",
    )

    # --- policy loss ------------------------------------------------------------------------
    gigpo_step_weight: float = Field(
        1.0, ge=0.0,
        description="GiGPO ω: weight of the step-level advantage (steps grouped by identical anchor states across "
                    "episodes of a group) added to the episode-level one. Agentic runs only (advantage: gigpo). "
                    "Feng et al. 2025, Group-in-Group Policy Optimization.",
    )
    policy_loss: str = Field(
        "ppo_clip",
        description="Policy loss by registered name: ppo_clip (PPO 1707.06347 with clip-higher and "
        "dual clip), cispo (clipped importance weight, MiniMax-M1 2506.13585), gspo (sequence-level "
        "ratio, 2507.18071).",
    )
    clip_ratio_low: float = Field(
        0.2, ge=0.0,
        description="Lower clip ε_low: the ratio is clipped at 1-ε_low. PPO uses 0.2; GSPO 3e-4; "
        "CISPO leaves the low side open (use ≥ 1).",
    )
    clip_ratio_high: float = Field(
        0.2, ge=0.0,
        description="Upper clip ε_high: the ratio is clipped at 1+ε_high. A higher value than "
        "ε_low ('clip-higher', DAPO 2503.14476, e.g. 0.28) keeps exploration alive; GSPO 4e-4.",
    )
    clip_ratio_c: float | None = Field(
        None, gt=1.0,
        description="Dual-clip constant c > 1 (Ye et al. 1912.09729, e.g. 3.0): for negative "
        "advantages the loss is capped at -A·c, so stale samples with huge ratios cannot blow up "
        "the update. None = off. ppo_clip only.",
    )
    loss_agg_mode: LossAggMode = Field(
        "token-mean",
        description="How per-token losses become a scalar: token-mean (every token weighs the same; "
        "DAPO), seq-mean-token-mean (every sequence weighs the same; original GRPO, biased towards "
        "short answers), seq-mean-token-sum, seq-mean-token-sum-norm (Dr.GRPO: divide by a constant "
        "length, see loss_scale_factor).",
    )
    loss_scale_factor: int | None = Field(
        None, gt=0,
        description="seq-mean-token-sum-norm only: the constant length divisor (Dr.GRPO uses the max "
        "response length). None = the padded length T of the batch, which changes with padding; "
        "set it for a loss independent of micro-batching.",
    )
    tis_cap: float | None = Field(
        None, gt=0.0,
        description="Truncated importance sampling for the rollout/training mismatch (Yao et al. "
        "2025): weight each token by min(π_train_old/π_rollout, tis_cap) using the inference "
        "engine's log-probs. None = off. Typical cap 2.0; lower caps reduce variance, add bias.",
    )
    tis_level: Literal["token", "sequence"] = Field(
        "token",
        description="TIS weight per token, or one weight per sequence (product of token ratios: "
        "unbiased for sequence rewards but much higher variance).",
    )
    old_logprobs: Literal["auto", "recompute", "behaviour"] = Field(
        "auto",
        description="π_old of the PPO ratio. recompute: the reference stage runs the current policy "
        "over the batch, so the ratio starts at exactly 1 whatever engine sampled. auto: the same "
        "update without that forward when the update is one on-policy pass (ppo_epochs 1, the "
        "batch fits one mini-batch, KL not in the rewards): π_old is then the training forward's "
        "own log-probs, detached, which is what recompute computes (as verl's on-policy path and "
        "TRL with num_iterations 1); otherwise recompute. behaviour: take the generation engine's "
        "per-token log-probs and skip that forward (the HF engine's agree with the recompute to "
        "float precision; vLLM's to ~1e-5). Not with tis_cap, whose weights compare the two.",
    )
    ppo_epochs: int = Field(
        1, ge=1,
        description="Passes over each rollout batch. More reuse per sample, but the policy drifts "
        "off-policy and the clip does more work.",
    )

    # --- critic -----------------------------------------------------------------------------
    cliprange_value: float | None = Field(
        0.5, gt=0.0,
        description="Value clip for the critic loss (PPO2): the new value may move at most this far "
        "from the old one before the loss stops rewarding it. None = unclipped MSE. gae only.",
    )
    critic_lr: float = Field(
        1e-3, gt=0.0, le=1.0,
        description="Critic learning rate (its own AdamW). The critic starts from the policy backbone "
        "with a fresh value head, so it usually takes a higher rate than the actor. gae only.",
    )
    critic_warmup_iterations: int = Field(
        0, ge=0,
        description="Iterations at the start of a run in which only the critic is trained (the actor "
        "is left unchanged), so GAE starts from useful values instead of an untrained head. gae only.",
    )

    # --- KL and entropy ---------------------------------------------------------------------
    kl_estimator: str = Field(
        "k3",
        description="KL(π‖π_ref) estimator by registered name (Schulman 2020), on the sampled tokens: "
        "k1 (unbiased, noisy, can go negative), k2 (½x², biased, low variance), k3 (unbiased, ≥ 0; "
        "GRPO), abs. 'full' (exact over the vocabulary) is refused: the update sees only the "
        "sampled tokens' reference log-probs (docs/algorithms.md).",
    )
    kl_coef: float = Field(
        0.001, ge=0.0,
        description="KL coefficient β (initial value when kl_ctrl='adaptive'). Higher keeps the "
        "policy near the reference, at the price of slower reward improvement. 0 = no KL, and the "
        "reference model's forward is skipped.",
    )
    use_kl_loss: bool = Field(
        True,
        description="True: add β·KL as a loss term (GRPO). False: subtract β·KL from the per-token "
        "rewards before the advantages (InstructGPT/PPO, Ziegler et al. 1909.08593).",
    )
    kl_ctrl: Literal["fixed", "adaptive"] = Field(
        "fixed",
        description="Fixed β, or adaptive β that is raised or lowered to keep the measured KL near "
        "kl_target (Ziegler et al. 1909.08593).",
    )
    kl_target: float = Field(
        0.1, gt=0.0,
        description="kl_ctrl='adaptive': target KL per token the controller steers towards.",
    )
    kl_horizon: int = Field(
        10000, ge=1,
        description="kl_ctrl='adaptive': samples over which β may change by ±20%; larger = slower.",
    )
    entropy_coef: float = Field(
        0.0, ge=0.0,
        description="Entropy bonus weight: loss -= entropy_coef · mean entropy. Fights entropy "
        "collapse, but too much makes outputs random. 0 = off (common for LLM RL).",
    )
    skip_zero_advantage: bool = Field(
        True,
        description="Skip the forward and backward of rows whose advantages are all zero (a GRPO "
        "group whose samples scored alike) when nothing else in the loss needs them: built-in "
        "policy loss (ppo_clip, cispo, gspo), no KL loss term with a non-zero β, entropy_coef 0. Their gradient is "
        "exactly zero, so the update is the same (the loss keeps the whole mini-batch's token and "
        "sequence counts); actor/entropy, actor/pg_clipfrac and actor/ppo_kl are then over the rows "
        "that ran, and actor/skipped_rows is the share skipped. False: run every row.",
    )

    # --- rewards: normalisation, clipping, shaping ------------------------------------------
    reward_norm: Literal["none", "batch", "group", "running"] = Field(
        "none",
        description="Normalise sequence scores before advantages: over the batch, within each "
        "prompt's group, or with running statistics kept across iterations. Keeps the scale of "
        "mixed reward sources comparable; 'group' on top of grpo is redundant.",
    )
    reward_clip: float | None = Field(
        None, gt=0.0,
        description="Clamp sequence scores to [-reward_clip, reward_clip] before normalisation "
        "(None = off). Guards against outlier rewards (e.g. from a model judge).",
    )
    overlong_buffer_len: int = Field(
        0, ge=0,
        description="Soft overlong punishment (DAPO 2503.14476): length of the buffer before "
        "overlong_max_len over which a linear penalty down to -overlong_penalty_factor is added to "
        "the score. 0 = off. Discourages rambling without the noise of hard truncation rewards.",
    )
    overlong_max_len: int | None = Field(
        None, gt=0,
        description="Soft overlong punishment: L_max, normally the max response length. Required "
        "when overlong_buffer_len > 0.",
    )
    overlong_penalty_factor: float = Field(
        1.0, ge=0.0,
        description="Soft overlong punishment: the penalty at L_max (the penalty is in [-factor, 0]).",
    )
    mask_truncated: bool = Field(
        False,
        description="Drop responses cut at the length limit (finish_reason == 'length') from the "
        "loss (DAPO overlong filtering): their reward says nothing about the answer, but dropping "
        "them hides length problems.",
    )
    difficulty_low: float = Field(
        0.0, ge=0.0, le=1.0,
        description="Difficulty mask (ROLL): drop prompts whose group pass rate is below this. 0.0 "
        "keeps all. Too-hard prompts give no signal under group baselines.",
    )
    difficulty_high: float = Field(
        1.0, ge=0.0, le=1.0,
        description="Difficulty mask (ROLL): drop prompts whose group pass rate is above this. 1.0 "
        "keeps all. Too-easy prompts give no signal under group baselines.",
    )
    filter_groups: bool = Field(
        False,
        description="Dynamic sampling (DAPO 2503.14476): drop groups whose rewards are all equal "
        "(zero advantage) and sample more prompts to refill the batch. Better gradient per batch, "
        "more rollout cost.",
    )
    max_generation_rounds: int = Field(
        4, ge=1, le=100,
        description="Dynamic sampling: the prompt budget per iteration, in batches (DAPO's "
        "max_num_gen_batches): the rollout scheduler (engines/generation/scheduler.py) samples at most "
        "prompts_per_iteration * max_generation_rounds prompts, the rollout's own batch included; "
        "when it is spent the batch trains on the groups it has. filter_groups only.",
    )

    @field_validator("advantage")
    @classmethod
    def _advantage_registered(cls, value: str) -> str:
        return _check_name("advantage", value, registry.ADVANTAGES)

    @field_validator("policy_loss")
    @classmethod
    def _policy_loss_registered(cls, value: str) -> str:
        return _check_name("policy_loss", value, registry.POLICY_LOSSES)

    @field_validator("kl_estimator")
    @classmethod
    def _kl_registered(cls, value: str) -> str:
        if value == "full":  # ROLL and verl spell it so; say why it is missing, not just that it is
            raise ValueError(
                "algorithm.kl_estimator = 'full' is not supported: the exact KL over the vocabulary needs "
                "the reference model's log-softmax [B,T,V] at every response token during the update, and "
                "the training step gets only the sampled tokens' reference log-probs [B,T] from the "
                f"reference stage; use one of {sorted(registry.KL_ESTIMATORS)} (k3 is unbiased and ≥ 0)")
        return _check_name("kl_estimator", value, registry.KL_ESTIMATORS)

    def old_logprobs_in_update(self, rows: int, mini_batch_size: int) -> bool:
        """Whether π_old comes from the actor update's own forward (`old_logprobs: auto` and the
        update is one on-policy pass over `rows` samples): then no stage before training has to
        recompute it. Only the rows count and settings decide, so the reference stage and the
        trainer agree; and either answer gives a valid update (a recomputed or behaviour π_old)."""
        kl_in_rewards = not self.use_kl_loss and self.kl_coef > 0  # the penalty needs π_old before the advantages
        return self.old_logprobs == "auto" and self.ppo_epochs == 1 and rows <= mini_batch_size and not kl_in_rewards

    def reference_needed(self) -> bool:
        """Whether the update reads the reference's log-probs: a KL term (kl_coef > 0) or an advantage
        estimator that declares ``ref_logprobs`` (on_policy_distill: the reference is the teacher)."""
        return self.kl_coef > 0 or "ref_logprobs" in inspect.signature(registry.get_advantage(self.advantage)).parameters

    @model_validator(mode="after")
    def _consistent(self) -> "AlgorithmConfig":
        if self.distill_reward_weight and self.advantage != "on_policy_distill":
            raise ValueError(f"algorithm.distill_reward_weight={self.distill_reward_weight} is read by advantage "
                             f"'on_policy_distill' only, not {self.advantage!r}: set it to 0")
        if self.advantage == "on_policy_distill" and not self.use_kl_loss and self.kl_coef > 0:
            raise ValueError(f"algorithm.advantage 'on_policy_distill' is already the reverse KL to the teacher (the "
                             f"reference) on every token; KL in the reward (use_kl_loss false, kl_coef={self.kl_coef}) "
                             "would add it a second time: set kl_coef: 0 (or use_kl_loss: true for an extra KL loss)")
        if self.difficulty_low > self.difficulty_high:
            raise ValueError(
                f"algorithm.difficulty_low = {self.difficulty_low} must be <= "
                f"algorithm.difficulty_high = {self.difficulty_high}"
            )
        if self.old_logprobs == "behaviour" and self.tis_cap is not None:
            raise ValueError(
                "algorithm.tis_cap needs algorithm.old_logprobs = 'recompute': with 'behaviour' the "
                "trainer's π_old is the engine's log-probs, so the TIS weight would always be 1"
            )
        if self.overlong_buffer_len > 0:
            if self.overlong_max_len is None or self.overlong_max_len <= self.overlong_buffer_len:
                raise ValueError(
                    f"algorithm.overlong_max_len = {self.overlong_max_len} must be set and greater "
                    f"than algorithm.overlong_buffer_len = {self.overlong_buffer_len}"
                )
        return self
