"""Write the quickstart's arithmetic tasks (deterministic): train.jsonl and eval.jsonl.

All 400 sums a + b with 1 <= a, b <= 20, shuffled; 64 are held out for evaluation and
never appear in training.
"""

import json
import random
from pathlib import Path

HELD_OUT = 64


def main() -> None:
    pairs = [(a, b) for a in range(1, 21) for b in range(1, 21)]
    random.Random(0).shuffle(pairs)
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    splits = {"eval": pairs[:HELD_OUT], "train": pairs[HELD_OUT:]}
    for name, rows in splits.items():
        with (out / f"{name}.jsonl").open("w") as f:
            for i, (a, b) in enumerate(rows):
                task = {
                    "id": f"{name}-{i}",
                    "question": f"What is {a} + {b}?",
                    "answer": str(a + b),
                }
                f.write(json.dumps(task) + "\n")


if __name__ == "__main__":
    main()
