"""The exact-match reward of the synthetic domains (`arithmetic`, `reverse`; registered as `exact_match` too):
the first line of the response, stripped, against the row's `answer`."""

from __future__ import annotations


def extract_answer(response: str) -> str:
    """The policy's answer: the response up to the first newline, stripped."""
    return response.split("\n", 1)[0].strip()


def exact_match_reward(response: str, sample: dict) -> float:
    """1.0 when the extracted answer equals the reference answer exactly, else 0.0."""
    return float(extract_answer(response) == str(sample["answer"]).strip())
