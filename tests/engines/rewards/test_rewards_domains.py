"""Domain rewards on real-looking responses: math (math-verify), code (sandbox), format (regex)."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest

pytest.importorskip("math_verify")

from engines.rewards.code import code_reward, extract_program  # noqa: E402
from engines.sandbox.isolation import isolation
from engines.rewards.fmt import THINK_THEN_ANSWER, format_reward  # noqa: E402
from engines.rewards.math import extract_answer, math_reward  # noqa: E402


def _m(answer):
    return {"prompt": "q", "answer": answer, "metadata": {}}


# --- math ------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, answer", [
    ("Half of the pie is left, so the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("So we get \\boxed{0.5}", "\\frac{1}{2}"),
    ("The fraction is \\boxed{1/2}.", "0.5"),
    ("Each gets ½ of it.\nAnswer: ½", "\\frac{1}{2}"),
    ("Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72", "72"),
    ("She earns 12 * 50 / 60 = 10 dollars per 50 minutes. So she earned 10 dollars.", "10"),
    ("$\\boxed{\\dfrac{\\sqrt{2}}{2}}$", "\\frac{\\sqrt2}{2}"),
    ("Expanding, \\boxed{1 + 2x}", "2x+1"),
    ("The roots form the set \\boxed{\\{2, 1\\}}", "\\{1,2\\}"),
    ("Total: \\boxed{1,000}", "1000"),
    ("First \\boxed{3}, then on reflection \\boxed{\\frac{6}{4}}", "1.5"),       # last box counts
    ("The answer is \\boxed{72.0}", "\\boxed{72}"),                             # boxed gold
])
def test_math_equivalent_forms_pass(response, answer):
    assert math_reward(response, _m(answer)) == 1.0


@pytest.mark.parametrize("response, answer", [
    ("The answer is \\boxed{\\frac{1}{3}}", "\\frac{1}{2}"),
    ("\\boxed{0.6}", "0.5"),
    ("#### 71", "72"),
    ("Answer: 2x - 1", "2x+1"),
    ("\\boxed{3} then \\boxed{4}", "3"),                                          # last box is wrong
])
def test_math_wrong_answers_score_zero(response, answer):
    assert math_reward(response, _m(answer)) == 0.0


@pytest.mark.parametrize("response", [
    "", "I don't know.", "\\boxed{", "\\boxed{}", "Answer:", "\\boxed{\\frac{1}{", "}}}{{{\\\\",
])
def test_math_malformed_responses_score_zero(response):
    assert math_reward(response, _m("\\frac{1}{2}")) == 0.0


def test_math_extract_answer():
    assert extract_answer("x \\boxed{\\frac{a}{b^{2}}} y") == "\\frac{a}{b^{2}}"
    assert extract_answer("steps\nFinal answer: 42.") == "42"
    assert extract_answer("#### 1,234") == "1,234"
    assert extract_answer("it is 3 or maybe -7.5") == "-7.5"
    assert extract_answer("no digits here") is None


def test_math_bad_reference_raises():
    with pytest.raises(KeyError, match="answer"):
        math_reward("\\boxed{1}", {"prompt": "q"})


def test_math_from_non_main_threads():
    with cf.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(math_reward, "\\boxed{0.5}", _m("\\frac{1}{2}")),
                pool.submit(math_reward, "\\boxed{7}", _m("8"))]
        assert [f.result(timeout=60) for f in futs] == [1.0, 0.0]
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("#### 72", _m("72"))))
    t.start()
    t.join(60)
    assert out == [1.0]


# --- code ------------------------------------------------------------------------------------

MBPP_TESTS = ["assert remove_Occ('hello','l') == 'heo'",
              "assert remove_Occ('abcda','a') == 'bcd'",
              "assert remove_Occ('PHP','P') == 'H'",
              "assert remove_Occ('aaa','a') == 'a'"]
HUMANEVAL_TESTS = ("def check(candidate):\n"
                   "    assert candidate([1.0, 2.0, 3.0], 0.5) == False\n"
                   "    assert candidate([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3) == True\n")


def _c(tests, **meta):
    return {"prompt": "write it", "tests": tests, "metadata": meta}


def test_code_correct_solution_passes():
    response = ("Here is my solution:\n```python\ndef remove_Occ(s, ch):\n"
                "    i, j = s.find(ch), s.rfind(ch)\n"
                "    if i == -1:\n        return s\n"
                "    s = s[:i] + s[i + 1:]\n    j = s.rfind(ch)\n"
                "    return s if j == -1 else s[:j] + s[j + 1:]\n```\nThis removes the first and last.")
    assert code_reward(response, _c(MBPP_TESTS)) == 1.0


def test_code_partial_credit():
    response = "```python\ndef remove_Occ(s, ch):\n    return s.replace(ch, '')\n```"   # wrong for 'aaa'
    assert code_reward(response, _c(MBPP_TESTS)) == 0.0
    assert code_reward(response, _c(MBPP_TESTS, partial_credit=True)) == pytest.approx(3 / 4)


def test_code_humaneval_harness_with_entry_point():
    good = ("```python\ndef has_close_elements(numbers, threshold):\n"
            "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n```")
    bad = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    sample = _c(HUMANEVAL_TESTS, entry_point="has_close_elements")
    assert code_reward(good, sample) == 1.0
    assert code_reward(bad, sample) == 0.0


def test_code_hostile_or_broken_programs_score_zero():
    assert code_reward("```python\nwhile True:\n    pass\n```", _c(MBPP_TESTS, timeout_s=1)) == 0.0
    assert code_reward("```python\nimport os\nos._exit(0)\n```", _c(MBPP_TESTS)) == 0.0
    assert code_reward("```python\ndef remove_Occ(:\n```", _c(MBPP_TESTS)) == 0.0
    lookup = "def remove_Occ(s, ch):\n    return {'hello': 'heo', 'abcda': 'bcd', 'PHP': 'H'}[s]\n"
    cheat = f"```python\nimport os\ntry:\n    open('/tmp/x', 'w')\nexcept Exception:\n    pass\n{lookup}```"
    if isolation().fs_view:   # the hook's refusal decides no verdict under bubblewrap: the attempt earns nothing
        assert code_reward(cheat, _c(MBPP_TESTS, partial_credit=True)) == \
            code_reward(f"```python\n{lookup}```", _c(MBPP_TESTS, partial_credit=True)) < 1.0
    else:                     # without bubblewrap the hook is a layer: "forbidden" scores 0
        assert code_reward(cheat, _c(MBPP_TESTS, partial_credit=True)) == 0.0
    assert code_reward("no code at all, sorry", _c(MBPP_TESTS)) == 0.0


def test_code_extract_program():
    assert extract_program("a\n```python\nx = 1\n```\nb\n```python\nx = 2\n```") == "x = 2\n"
    assert extract_program("```\ny = 1\n```") == "y = 1\n"
    assert extract_program("```py\nz = 1\n```\n```text\nout\n```") == "z = 1\n"
    assert extract_program("print(1)") == "print(1)"


def test_code_missing_tests_raises():
    with pytest.raises(KeyError, match="tests"):
        code_reward("```python\npass\n```", {"prompt": "p", "metadata": {}})


# --- format ----------------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    ("<think>2+2</think><answer>4</answer>", 1.0),
    ("so \\boxed{4}", 1.0),
    ("the answer is 4", 0.0),
    ("<answer></answer>", 0.0),
    ("<answer>4", 0.0),
    ("", 0.0),
])
def test_format_default_pattern(response, expected):
    assert format_reward(response, {"prompt": "q", "metadata": {}}) == expected


def test_format_custom_patterns():
    strict = {"prompt": "q", "metadata": {"format_pattern": THINK_THEN_ANSWER}}
    assert format_reward("<think>\nadd\n</think>\n<answer>4</answer>\n", strict) == 1.0
    assert format_reward("<answer>4</answer>", strict) == 0.0
    assert format_reward("Result: 4", {"metadata": {}}, pattern=r"^Result: \d+$") == 1.0
    with pytest.raises(ValueError, match="not a valid regex"):
        format_reward("x", {"metadata": {}}, pattern="(")
