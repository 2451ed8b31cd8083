"""Writes the tiny presets' demonstration and preference files (configs/sft_tiny.yaml, configs/dpo_tiny.yaml)
from the bundled synthetic tasks (engines/data/synthetic.py): train-split problems, disjoint from the
fixed eval split.

    python -m configs.data.make_tiny_data        # rewrites configs/data/tiny_demonstrations.jsonl and tiny_pairs.jsonl

A demonstration is the correct answer; a pair's chosen response is the correct answer and its
rejected one the teacher's systematic mistake (`teacher_demonstration` at accuracy 0), the habit the
tiny policy's bootstrap learned (model.bootstrap.teacher_accuracy 0.4).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from engines.data.synthetic import make_problems, teacher_demonstration

HERE = Path(__file__).parent


def rows(n: int, seed: int, pairs: bool) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for p in make_problems("train", n, seed=seed):
        good, bad = teacher_demonstration(p, rng, 1.0), teacher_demonstration(p, rng, 0.0)
        if pairs and good == bad:   # a problem whose mistake gives the right answer carries no preference
            continue
        row = {"prompt": p.prompt, "domain": p.domain, "answer": p.answer}
        out.append({**row, "chosen": good, "rejected": bad} if pairs else {**row, "response": good})
    return out


def main() -> None:
    for name, n, seed, pairs in (("tiny_demonstrations.jsonl", 2000, 11, False), ("tiny_pairs.jsonl", 1000, 12, True)):
        with open(HERE / name, "w") as f:
            for r in rows(n, seed, pairs):
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
