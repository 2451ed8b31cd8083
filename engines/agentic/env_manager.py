# longer than 400 lines: the lock-step episode loop and the token bookkeeping both managers share
"""The environment manager: many multi-turn episodes in lock-step, one batched generation per turn.

Token-in/token-out. An episode is kept as token ids, never as text to re-tokenise:
    prompt_token_ids   = tokenize(instructions + first observation)            (once)
    response_token_ids = a_1 + o_1 + a_2 + o_2 + ... + a_n
where a_k are the policy's generated ids of turn k exactly as the engine returned them (EOS
included when sampled) and o_k = tokenize(reply of the environment to a_k). The next turn's
context is prompt + response so far, so the training sequence is exactly what the policy saw and
produced. ``loss_mask`` is 1 on the a_k tokens and 0 on the o_k tokens; ``behaviour_logprobs``
holds the engine's log-probs on a_k and 0.0 on o_k. The environment's reply to the last action
(or to an action that ends the episode) is not appended: the policy never reads it.

Chat models (``chat=True``): the first prompt is the tokenizer's chat template over a system turn
(the instructions) and a user turn (the first observation), ending with the assistant header; each
environment reply is wrapped as the template wraps a user turn — end of the assistant turn (skipped
when the policy already produced the end-of-turn token), user header, observation, end of turn,
assistant header — so an instruct model reads a normal conversation, still token-in/token-out.

Environments may shape their turns (``EnvTurns``, read from optional attributes of the env): their
own ``stop`` strings end a turn as ``sampling.stop`` does (tool_table: ``</tool_call>``,
``</answer>``); ``tool_specs`` are rendered by the chat template (``apply_chat_template(...,
tools=...)``) when it takes ``tools=`` (``ChatFormat.takes_tools``), with the env's plain-text
description (``tools_preamble``, the end of its instructions) dropped so they are described once;
otherwise the instructions keep that plain-text description.

Truncation: before appending a reply, if prompt + response + reply + ``max_new_tokens`` would pass
``max_context_tokens`` the episode stops there with ``truncated = True`` (the reply is dropped).
An environment that raises in ``step`` ends its episode (``env_error`` set), never the batch.

Notation: E episodes (= len(seeds) × group_size), n turns per episode.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from engines.agentic.envs import make_env
from engines.generation.engine import GenerationEngine, SamplingParams


@dataclass
class Episode:
    seed: int
    group_id: int                        # index of the seed in ``seeds``; the GRPO/GiGPO group
    sample_id: int                       # 0..group_size-1
    prompt: str                          # decoded first prompt (instructions + first observation)
    prompt_token_ids: list[int]
    response_token_ids: list[int] = field(default_factory=list)   # a_1 o_1 a_2 o_2 ... a_n
    loss_mask: list[int] = field(default_factory=list)            # 1 on policy tokens, 0 on env tokens
    behaviour_logprobs: list[float] = field(default_factory=list) # engine log-probs; 0.0 on env tokens
    turn_index: list[int] = field(default_factory=list)           # turn (0-based) of each policy token, -1 on env tokens
    actions: list[str] = field(default_factory=list)              # decoded a_k
    env_replies: list[str] = field(default_factory=list)          # o_k as appended (n or n-1 of them)
    turn_rewards: list[float] = field(default_factory=list)       # reward of each turn
    state_keys: list[str] = field(default_factory=list)           # env state before each action (GiGPO anchor)
    valid_actions: list[bool] = field(default_factory=list)
    effective_actions: list[bool] = field(default_factory=list)
    success: bool = False
    done: bool = False                   # the environment ended the episode
    truncated: bool = False              # stopped by max_context_tokens
    env_error: str | None = None         # the exception an env.step raised, if any
    final_reply: str = ""                # the environment's last reply (not in the token sequence)
    env_timeout: bool = False            # async manager: a step ran past its timeout (env_error says so)
    policy_versions: list[int] = field(default_factory=list)  # async manager: engine's policy version at each turn
    score: float | None = None           # the env's own score of the outcome (info["score"], e.g. WebShop's), if it gives one

    @property
    def turns(self) -> int:
        return len(self.actions)

    @property
    def episode_return(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def num_effective(self) -> int:
        return sum(self.effective_actions)

    @property
    def num_invalid(self) -> int:
        return sum(not v for v in self.valid_actions)

    @property
    def finish_reason(self) -> str:
        """``done`` | ``max_turns`` | ``truncated`` | ``env_error``."""
        if self.env_error is not None:
            return "env_error"
        if self.truncated:
            return "truncated"
        return "done" if self.done else "max_turns"

    @property
    def transcript(self) -> str:
        """Readable text of the episode (for decks and logs)."""
        head = (f"seed {self.seed}, group {self.group_id}, sample {self.sample_id}: "
                f"{'success' if self.success else 'failure'}, return {self.episode_return:.2f}, "
                f"{self.turns} turns, {self.finish_reason}")
        lines = [head, self.prompt.rstrip("\n")]
        for k, action in enumerate(self.actions):
            flags = "valid" if self.valid_actions[k] else "invalid"
            flags += ", effective" if self.effective_actions[k] else ""
            lines.append(f"[turn {k + 1}] policy: {action.strip()!s}   (reward {self.turn_rewards[k]:.2f}, {flags})")
            reply = self.env_replies[k] if k < len(self.env_replies) else self.final_reply
            if reply:
                lines.append(f"[turn {k + 1}] env: " + reply.strip("\n"))
        if self.env_error:
            lines.append(f"[env error] {self.env_error}")
        return "\n".join(lines)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reply_text(action_text: str, observation: str) -> str:
    """The text appended after an action: the observation, on a new line if the action had none."""
    return observation if action_text.endswith("\n") or not action_text else "\n" + observation


@dataclass(frozen=True)
class EnvTurns:
    """What an environment adds to its turns' framing, from optional attributes of the env: ``stop``,
    strings that end a policy turn (merged into ``sampling.stop``); ``tool_specs``, JSON-schema tool
    specs for the chat template's ``tools=``; ``tools_preamble``, the end of ``instructions`` that
    describes those tools in plain text ("" when the instructions do not describe them)."""
    stop: tuple[str, ...] = ()
    tool_specs: tuple = ()
    tools_preamble: str = ""

    @classmethod
    def of(cls, env) -> "EnvTurns":
        return cls(tuple(getattr(env, "stop", ()) or ()), tuple(getattr(env, "tool_specs", ()) or ()),
                   getattr(env, "tools_preamble", "") or "")

    def sampling(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` with the environment's stop strings added (order kept, no repeats)."""
        stop = tuple(dict.fromkeys((*sampling.stop, *self.stop)))
        return sampling if stop == tuple(sampling.stop) else dataclasses.replace(sampling, stop=stop)


_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "p",
                                                   "parameters": {"type": "object", "properties": {}}}}]


@dataclass(frozen=True)
class ChatFormat:
    """How the tokenizer's chat template frames a conversation, cut into the pieces a multi-turn
    episode needs: ``first(instructions, observation)`` is the rendered system + user turn with the
    assistant header; an environment reply is ``end_of_turn + user_open + observation + user_close``
    (``user_close`` holds the next assistant header)."""
    tokenizer: object
    end_of_turn: str
    user_open: str
    user_close: str
    takes_tools: bool = False   # the template renders ``tools=`` (Qwen2.5, Hermes; SmolLM2's ignores it)

    @classmethod
    def of(cls, tokenizer) -> "ChatFormat":
        X, Y, Z = "\x01X\x01", "\x01Y\x01", "\x01Z\x01"   # markers no template contains
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": "s"}, {"role": "user", "content": X}, {"role": "assistant", "content": Y},
             {"role": "user", "content": Z}], add_generation_prompt=True, tokenize=False)
        between, after = text.split(Y, 1)[1].split(Z, 1)
        eos = tokenizer.eos_token or ""
        end = between[: between.index(eos) + len(eos)] if eos and eos in between else ""
        return cls(tokenizer, end, between[len(end):], after, _takes_tools(tokenizer))

    def first(self, instructions: str, observation: str, tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "system", "content": instructions.strip()}, {"role": "user", "content": observation}],
            add_generation_prompt=True, tokenize=False, **({"tools": tools} if tools else {}))

    def reply(self, action_ids: list[int], observation: str) -> str:
        ended = bool(action_ids) and action_ids[-1] == self.tokenizer.eos_token_id
        return ("" if ended else self.end_of_turn) + self.user_open + observation + self.user_close


def _takes_tools(tokenizer) -> bool:
    """Whether the chat template renders ``tools=``: a conversation with a probe tool renders
    differently from the same one without."""
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    plain = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    try:
        with_tools = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, tools=_PROBE_TOOLS)
    except Exception:  # noqa: BLE001 -- a template that fails on tools= does not take them
        return False
    return with_tools != plain


def run_episodes(
    engine: GenerationEngine,
    tokenizer,
    env_name: str,
    seeds: list[int],
    *,
    group_size: int,
    max_turns: int,
    max_context_tokens: int,
    sampling: SamplingParams,
    env_kwargs: dict | None = None,
    chat: bool = False,
) -> list[Episode]:
    """Run ``len(seeds) × group_size`` episodes of ``env_name`` in lock-step; one
    ``engine.generate`` call per turn over all live episodes (n=1 each). Returns the episodes
    ordered by (group, sample). Use ``sampling.stop=("\\n",)`` so a turn ends at its line (the
    environment's own ``stop`` strings are added, ``EnvTurns``); ``chat=True`` frames the episode
    with the tokenizer's chat template (``ChatFormat``, the env's ``tool_specs`` as its ``tools=``)."""
    fmt = ChatFormat.of(tokenizer) if chat else None
    if group_size < 1 or max_turns < 1:
        raise ValueError(f"group_size and max_turns must be >= 1, got {group_size} and {max_turns}")
    envs, episodes = [], []
    for g, seed in enumerate(seeds):
        for s in range(group_size):
            env = make_env(env_name, **(env_kwargs or {}))
            turns = EnvTurns.of(env)   # the same for every episode: one env_name, one env_kwargs
            try:
                observation = env.reset(seed)
                first = first_prompt(fmt, env.instructions, observation, turns)
            except Exception as e:  # a broken reset is a configuration error: say which seed
                raise RuntimeError(f"environment {env_name!r} failed to reset with seed {seed}: {e!r}") from e
            ids = _encode(tokenizer, first)
            check_first_prompt(ids, env_name, seed, sampling.max_new_tokens, max_context_tokens)
            envs.append(env)
            episodes.append(Episode(seed=seed, group_id=g, sample_id=s, prompt=first, prompt_token_ids=ids))
    live = list(range(len(episodes)))
    if envs:
        sampling = EnvTurns.of(envs[0]).sampling(sampling)
    for turn in range(max_turns):
        if not live:
            break
        params = dataclasses.replace(sampling, n=1, seed=None if sampling.seed is None else sampling.seed + 1009 * turn)
        contexts = [episodes[i].prompt_token_ids + episodes[i].response_token_ids for i in live]
        completions = sorted(engine.generate(contexts, params), key=lambda c: (c.prompt_index, c.sample_index))
        still_live = []
        for i, comp in zip(live, completions):
            ep, env = episodes[i], envs[i]
            action = record_action(ep, comp.token_ids, comp.logprobs, turn, env.state_key(), tokenizer)
            try:
                observation, reward, done, info = env.step(action)
            except Exception as e:  # costs this episode only
                observation, reward, done, info = "", 0.0, True, FAILED_STEP_INFO
                ep.env_error = env_error_text(e)
            if record_reply(ep, comp.token_ids, action, observation, reward, done, info, last_turn=turn == max_turns - 1,
                            tokenizer=tokenizer, fmt=fmt, max_new_tokens=sampling.max_new_tokens,
                            max_context_tokens=max_context_tokens):
                still_live.append(i)
        live = still_live
    return episodes


# The pieces of one turn, shared with the asynchronous manager (engines/agentic/async_env_manager.py) so both
# build episodes by the same rules.

FAILED_STEP_INFO = {"valid_action": False, "effective": False, "success": False}  # info of a step that raised


def env_error_text(e: BaseException) -> str:
    """``Episode.env_error`` of an exception an environment raised: ``"Type: message"``."""
    return f"{type(e).__name__}: {e}"


def first_prompt(fmt: "ChatFormat | None", instructions: str, observation: str, turns: EnvTurns = EnvTurns()) -> str:
    """The first prompt's text: the chat template's system + user turns, or instructions + observation.
    An environment with ``tool_specs`` under a template that takes ``tools=`` gets them rendered by the
    template, its instructions without their plain-text ``tools_preamble``; otherwise that preamble
    must be there (else the tools would be described nowhere: ``ValueError``)."""
    if fmt is not None and turns.tool_specs and fmt.takes_tools:
        return fmt.first(instructions.removesuffix(turns.tools_preamble), observation, tools=list(turns.tool_specs))
    if turns.tool_specs and not turns.tools_preamble:
        raise ValueError("the environment's tools are described neither by the chat template (chat off, or its template "
                         "ignores tools=) nor in its instructions (no tools_preamble): build the environment with its "
                         "plain-text tool description on (tool_table: describe_tools=True)")
    return fmt.first(instructions, observation) if fmt else instructions + observation


def check_first_prompt(ids: list[int], env_name: str, seed: int, max_new_tokens: int, max_context_tokens: int) -> None:
    """A first prompt that cannot fit one turn is a ``ValueError`` naming ``max_context_tokens``."""
    if len(ids) + max_new_tokens > max_context_tokens:
        raise ValueError(f"max_context_tokens={max_context_tokens} is too small: the first prompt of {env_name!r} "
                         f"seed {seed} has {len(ids)} tokens + max_new_tokens={max_new_tokens}")


def record_action(ep: Episode, token_ids: list[int], logprobs: list[float], turn: int, state_key: str, tokenizer) -> str:
    """Append turn ``turn``'s generated ids (loss 1, their log-probs) to ``ep``, with the state the
    action was taken in; returns the decoded action."""
    ep.state_keys.append(state_key)
    ep.response_token_ids += token_ids
    ep.loss_mask += [1] * len(token_ids)
    ep.behaviour_logprobs += [float(x) for x in logprobs]
    ep.turn_index += [turn] * len(token_ids)
    action = tokenizer.decode(token_ids, skip_special_tokens=True)
    ep.actions.append(action)
    return action


def record_reply(ep: Episode, action_ids: list[int], action: str, observation: str, reward: float, done: bool,
                 info: dict, *, last_turn: bool, tokenizer, fmt: "ChatFormat | None", max_new_tokens: int,
                 max_context_tokens: int) -> bool:
    """Record the environment's answer to the action just recorded: the turn's reward and flags, then
    either the end of the episode (done, an error in ``ep.env_error``, the last turn, or truncation:
    the reply is kept in ``final_reply`` only) or the reply appended with loss 0. True while the
    episode goes on."""
    ep.turn_rewards.append(float(reward))
    ep.valid_actions.append(bool(info.get("valid_action", False)))
    ep.effective_actions.append(bool(info.get("effective", False)))
    ep.success = bool(info.get("success", False))
    if info.get("score") is not None:
        ep.score = float(info["score"])
    if done or ep.env_error is not None or last_turn:
        ep.done, ep.final_reply = bool(done) and ep.env_error is None, observation
        return False
    reply = fmt.reply(action_ids, observation) if fmt else reply_text(action, observation)
    reply_ids = _encode(tokenizer, reply)
    context_len = len(ep.prompt_token_ids) + len(ep.response_token_ids) + len(reply_ids)
    if context_len + max_new_tokens > max_context_tokens:
        ep.truncated, ep.final_reply = True, reply
        return False
    ep.env_replies.append(reply)
    ep.response_token_ids += reply_ids
    ep.loss_mask += [0] * len(reply_ids)
    ep.behaviour_logprobs += [0.0] * len(reply_ids)
    ep.turn_index += [-1] * len(reply_ids)
    return True


def token_rewards(episode: Episode, per_turn: bool = False) -> list[float]:
    """Rewards aligned with ``response_token_ids``: the episode return on the last policy token
    (``per_turn=False``, trajectory level), or each turn's reward on that turn's last policy token."""
    out = [0.0] * len(episode.response_token_ids)
    last_of_turn: dict[int, int] = {}
    for pos, k in enumerate(episode.turn_index):
        if k >= 0:
            last_of_turn[k] = pos
    if not last_of_turn:
        return out
    if per_turn:
        for k, pos in last_of_turn.items():
            out[pos] += episode.turn_rewards[k]
    else:
        out[max(last_of_turn.values())] = episode.episode_return
    return out


def episode_metrics(episodes: list[Episode], prefix: str = "env") -> dict[str, float]:
    """``env/success_rate``, ``env/effective_action_rate`` and ``env/invalid_action_rate`` (shares of
    all actions), ``env/turns`` and ``env/return`` (means per episode), ``env/truncated_rate``,
    ``env/env_error_rate``; ``env/score`` where the environment scores outcomes (``info["score"]``:
    WebShop's score, whatever its ``reward`` pays), the mean over episodes with 0 for one it did not
    score (no purchase)."""
    if not episodes:
        return {}
    actions = sum(ep.turns for ep in episodes) or 1
    scored = any(ep.score is not None for ep in episodes)
    return {
        **({f"{prefix}/score": statistics.fmean(ep.score or 0.0 for ep in episodes)} if scored else {}),
        f"{prefix}/success_rate": statistics.fmean(float(ep.success) for ep in episodes),
        f"{prefix}/effective_action_rate": sum(ep.num_effective for ep in episodes) / actions,
        f"{prefix}/invalid_action_rate": sum(ep.num_invalid for ep in episodes) / actions,
        f"{prefix}/turns": statistics.fmean(ep.turns for ep in episodes),
        f"{prefix}/return": statistics.fmean(ep.episode_return for ep in episodes),
        f"{prefix}/truncated_rate": statistics.fmean(float(ep.truncated) for ep in episodes),
        f"{prefix}/env_error_rate": statistics.fmean(float(ep.env_error is not None) for ep in episodes),
    }


WASTED_MOVES = ("left", "down", "right", "up")   # candidates for the imperfect teacher's habit


def _tried_moves(env):
    """For each of ``WASTED_MOVES`` in order, lazily: (move, a copy of ``env`` after it, done, info).
    ``env`` itself is not touched."""
    import copy

    for move in WASTED_MOVES:
        trial = copy.deepcopy(env)
        _, _, done, info = trial.step(move + "\n")
        yield move, trial, done, info


def wasted_action(env) -> str | None:
    """The first of ``WASTED_MOVES`` that is valid but leaves the state unchanged (and does not end
    the episode), tried on a copy of ``env``; None if there is none (e.g. ToolMath)."""
    key = env.state_key()
    for move, trial, done, info in _tried_moves(env):
        if info.get("valid_action") and not info.get("effective") and not done and trial.state_key() == key:
            return move
    return None


def detour_action(env, planned: str, rng) -> str | None:
    """A random one of ``WASTED_MOVES`` other than ``planned`` that is valid and effective, does not
    end the episode and leaves the goal reachable (``env.solve()`` finds a plan), tried on copies of
    ``env``; None if there is none."""
    options = [move for move, trial, done, info in _tried_moves(env)
               if move != planned and info.get("valid_action") and info.get("effective") and not done and trial.solve()]
    return rng.choice(options) if options else None


def shortest_plan_moves(env, plan: list[str]) -> list[str]:
    """Every one of ``WASTED_MOVES`` that starts a shortest plan as long as ``plan`` (ends the episode
    in success with one move left, or reaches a state ``env.solve()`` finishes in len(plan) - 1), tried
    on copies of ``env``, in ``WASTED_MOVES`` order; ``[plan[0]]`` for an environment whose actions
    are not moves (ToolMath)."""
    if plan[0] not in WASTED_MOVES:
        return [plan[0]]
    moves = []
    for move, trial, done, info in _tried_moves(env):
        if not info.get("effective"):
            continue
        rest = None if done else trial.solve()
        if (done and info.get("success") and len(plan) == 1) or (rest is not None and len(rest) == len(plan) - 1):
            moves.append(move)
    return moves or [plan[0]]


def solved_episodes(env_name: str, seeds: list[int], *, max_turns: int, env_kwargs: dict | None = None,
                    habit_rate: float = 0.0, habit_seed: int = 0, detour_rate: float = 0.0,
                    segments: bool = False, random_ties: bool = False,
                    fmt: "ChatFormat | None" = None) -> list[tuple[str, str | list[tuple[str, bool]]]]:
    """(prompt, response) demonstrations by the environment's scripted solver, laid out exactly as
    ``run_episodes`` lays out text: the first prompt (``first_prompt``), each action as the engine
    would end it (on its own line, or at one of the environment's ``stop`` strings when it ends with
    one), then the environment's reply (``reply_text``, or with ``fmt`` the chat template's user turn,
    ``ChatFormat.reply``); no reply after the last action. Re-plans after every step (slippery
    FrozenLake); seeds the solver cannot finish within ``max_turns`` are skipped. An episode is
    kept when it ends in success, or, for an environment with a ``teacher_finished(info)`` method,
    when that says the teacher ended it as it meant to (webshop's ``teacher_option_rate``: a purchase
    without the options). For ``engines.training.pretrain.supervised_finetune``.
    ``segments=True``: each response is a list of (text, is_action) segments instead of one string
    (the same text), so the fine-tune can put its loss on the actions only.

    ``habit_rate`` > 0 makes the teacher imperfect: before each planned move, with that probability
    (``random.Random(habit_seed)``), it first wastes a turn on ``wasted_action(env)`` when one
    exists — a habit the pre-trained policy inherits and RL must unlearn.

    ``detour_rate`` > 0 widens the states the corpus covers (noise injection, DART: Laskey et al.
    2017, "DART: Noise Injection for Robust Imitation Learning"): before a planned move, with that
    probability (same generator) the teacher first takes ``detour_action(env, plan[0], rng)`` — an
    effective move other than the planned one that leaves the goal reachable — and re-plans from
    where it lands. Shortest-path demonstrations only show states on shortest paths; a policy that
    strays once is then somewhere it never saw a demonstration (FrozenLake: beside a hole, needing
    an ``up`` or ``left`` that shortest paths never take). The detour's own step is a demonstration
    of a mistake, so keep the rate well below the planned move's share.

    ``random_ties=True``: where several moves start a shortest plan (``shortest_plan_moves``) the
    teacher picks one at random (same generator) instead of the solver's first. A breadth-first
    solver breaks ties in a fixed move order, so on FrozenLake every demonstration goes down before
    right wherever it can, and a policy copies that order (down, down, down, right, right, right on
    every map) without reading the map; with random ties the only rule the demonstrations share is
    the map's (do not step into a hole or the border)."""
    import random

    rng = random.Random(habit_seed)
    pairs = []
    for seed in seeds:
        env = make_env(env_name, **(env_kwargs or {}))
        turns = EnvTurns.of(env)
        prompt = first_prompt(fmt, env.instructions, env.reset(seed), turns)
        parts, success = [], False
        wasted_here = False
        for turn in range(max_turns):
            plan = env.solve()
            if not plan:
                break
            move = wasted_action(env) if habit_rate > 0 and not wasted_here and rng.random() < habit_rate else None
            wasted_here = move is not None          # at most one wasted turn in a row
            if move is None and detour_rate > 0 and rng.random() < detour_rate:
                move = detour_action(env, plan[0], rng)
            if move is None:
                move = rng.choice(shortest_plan_moves(env, plan)) if random_ties else plan[0]
            action = move if move.endswith(tuple(turns.stop)) else move + "\n"   # where the engine's stop ends it
            observation, _, done, info = env.step(action)
            parts.append((action, True))
            if done or turn == max_turns - 1:
                finished = getattr(env, "teacher_finished", None)
                success = bool(finished(info) if finished else info.get("success"))
                break
            parts.append((fmt.reply([], observation) if fmt else reply_text(action, observation), False))
        if success:
            pairs.append((prompt, parts if segments else "".join(text for text, _ in parts)))
    return pairs
