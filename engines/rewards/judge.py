"""Judged-QA reward: a model grades each response with a rubric, through a generation engine.

In the line of MT-Bench's LLM-as-a-judge (Zheng et al. 2023, arXiv 2306.05685) and ROLL's
`LLMJudgeRewardWorker`: the rubric prompt holds the question, the response and (when the sample
has one) the reference answer; the judge decodes greedily; its verdict is parsed into [0, 1].

`parse_score` accepts, last occurrence winning: `[[8]]`, `Score: 7/10`, `Rating: 4 out of 5`,
`7/10`, `Score: 7` (over `scale`), `Score: seven`, a bare number (`7`, `7.5`) or a verdict word
(`correct` / `incorrect`, `yes` / `no`, `pass` / `fail`) as the whole output. Anything else, or a
number outside its scale, is unparsable: `score_batch` returns (0.0, error) for it and `__call__`
raises, so the reward worker scores the sample 0 and flags it (a judge failure is never a silent 0).
"""

from __future__ import annotations

import re

from engines.generation.engine import GenerationEngine, SamplingParams

DEFAULT_RUBRIC = (
    "You are a strict grader. Rate the response to the question on a scale of 0 to 10 for "
    "correctness and helpfulness.{reference_block}\n\n[Question]\n{prompt}\n\n[Response]\n{response}\n\n"
    "Reply with your rating in the form: Score: N/10"
)

_NUM = r"(\d+(?:\.\d+)?)"
_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten".split())}
_WORD_NUM = r"(\d+(?:\.\d+)?|" + "|".join(_WORDS) + r")"
_PATTERNS = (   # (regex, has explicit denominator)
    (re.compile(r"\[\[\s*" + _NUM + r"\s*(?:/\s*" + _NUM + r")?\s*\]\]"), True),
    (re.compile(r"\b(?:score|rating|grade)\b[^0-9a-z\n]{0,5}" + _WORD_NUM + r"\b(?:\s*(?:/|out of)\s*" + _NUM + r")?", re.I), True),
    (re.compile(_NUM + r"\s*(?:/|out of)\s*" + _NUM, re.I), True),
)
_BARE = re.compile(r"^\s*" + _NUM + r"\s*[.!]?\s*$")
_VERDICTS = {"correct": 1.0, "right": 1.0, "yes": 1.0, "pass": 1.0, "good": 1.0,
             "incorrect": 0.0, "wrong": 0.0, "no": 0.0, "fail": 0.0, "bad": 0.0}


def _number(text: str) -> float:
    return float(_WORDS[text.lower()]) if text.lower() in _WORDS else float(text)


def parse_score(text: str, scale: float = 10.0) -> float:
    """The judge's verdict in `text` normalised to [0, 1]; ValueError when there is none."""
    text = text or ""
    best = None        # (position, value, denominator)
    for rx, _ in _PATTERNS:
        for m in rx.finditer(text):
            value, denom = m.group(1), m.group(2)
            if best is None or m.start() > best[0] or (m.start() == best[0] and denom and not best[2]):
                best = (m.start(), _number(value), float(denom) if denom else None)
    if best is None:
        bare = _BARE.match(text)
        if bare:
            best = (0, float(bare.group(1)), None)
    if best is not None:
        _, value, denom = best
        top = denom or scale
        if top <= 0 or not 0 <= value <= top:
            raise ValueError(f"judge score {value:g} is outside 0..{top:g} in {text[:200]!r}")
        return value / top
    word = re.fullmatch(r"\s*\**\s*([A-Za-z]+)\s*\**\s*[.!]?\s*", text)
    if word and word.group(1).lower() in _VERDICTS:
        return _VERDICTS[word.group(1).lower()]
    raise ValueError(f"judge output has no score: {text[:200]!r}")


class JudgeReward:
    """Reward = the judge model's parsed rating of (prompt, response[, reference answer]).

    `rubric_template` is a str.format template with `{prompt}`, `{response}` and optionally
    `{reference}` / `{reference_block}` (empty without a reference answer). The rendered rubric
    goes through the tokenizer's chat template when it has one, and is cut from the left to
    `max_prompt_tokens`."""

    def __init__(self, engine: GenerationEngine, tokenizer, rubric_template: str = DEFAULT_RUBRIC,
                 max_new_tokens: int = 32, *, scale: float = 10.0, max_prompt_tokens: int | None = None,
                 use_chat_template: bool | None = None):
        if "{response}" not in rubric_template:
            raise ValueError("JudgeReward: rubric_template must contain '{response}' (and usually '{prompt}')")
        self.engine, self.tokenizer = engine, tokenizer
        self.rubric_template, self.max_new_tokens, self.scale = rubric_template, max_new_tokens, scale
        self.max_prompt_tokens = max_prompt_tokens
        self.use_chat_template = bool(getattr(tokenizer, "chat_template", None)) if use_chat_template is None else use_chat_template

    def render(self, response: str, sample: dict) -> str:
        ref = sample.get("answer")
        return self.rubric_template.format(
            prompt=sample.get("prompt", ""), response=response or "", reference="" if ref is None else str(ref),
            reference_block="" if ref is None else f"\n\n[Reference answer]\n{ref}")

    def _token_ids(self, text: str) -> list[int]:
        if self.use_chat_template:
            from engines.models.modeling import encode_prompts

            (ids,) = encode_prompts(self.tokenizer, [text], apply_chat_template=True)
        else:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[-self.max_prompt_tokens:] if self.max_prompt_tokens else ids

    def judge(self, responses: list[str], samples: list[dict]) -> list[str]:
        """The judge's raw outputs, one greedy generation per (response, sample), in one batch."""
        if len(responses) != len(samples):
            raise ValueError(f"JudgeReward: {len(responses)} responses but {len(samples)} samples")
        prompts = [self._token_ids(self.render(r, s)) for r, s in zip(responses, samples)]
        outs = self.engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=self.max_new_tokens))
        texts = [""] * len(prompts)
        for c in outs:
            texts[c.prompt_index] = c.text or self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return texts

    def score_batch(self, responses: list[str], samples: list[dict]) -> list[tuple[float, str | None]]:
        """[(score in [0, 1], None) or (0.0, "unparsable judge output ...")] per response."""
        out = []
        for text in self.judge(responses, samples):
            try:
                out.append((parse_score(text, self.scale), None))
            except ValueError as e:
                out.append((0.0, str(e)))
        return out

    def __call__(self, response: str, sample: dict) -> float:
        """One sample's score; raises ValueError when the judge's output has no parsable score."""
        score, error = self.score_batch([response], [sample])[0]
        if error:
            raise ValueError(error)
        return score
