"""A reward the barely-trained e2e policy can earn, so the end-to-end test sees a real GRPO signal
(reward variance inside groups -> non-zero advantages -> parameters move)."""


def starts_with_digit(response: str, sample: dict) -> float:
    return float(response[:1].isdigit())
