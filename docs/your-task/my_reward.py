import re


def close_enough(response: str, sample: dict) -> float:
    """1.0 for the exact number, 0.5 within 10 % of it, else 0.0 (partial credit)."""
    found = re.search(r"-?\d+", response)
    if found is None:
        return 0.0
    got, want = int(found.group()), int(sample["answer"])
    return 1.0 if got == want else 0.5 if abs(got - want) <= 0.1 * abs(want) else 0.0
