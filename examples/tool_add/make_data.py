"""Writes data/train.jsonl and data/eval.jsonl: sums of two 4-digit numbers, which a small model gets wrong in its
head and right with the add tool. Rows are conversations (a `prompt` column of chat messages) with an `answer`.

    python make_data.py
"""

import json
import random
from pathlib import Path


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
        question = f"What is {a} + {b}? Call the add tool, then reply with the sum only."
        out.append({"prompt": [{"role": "user", "content": question}], "answer": str(a + b)})
    return out


if __name__ == "__main__":
    here = Path(__file__).parent / "data"
    here.mkdir(exist_ok=True)
    for name, n, seed in (("train", 256, 0), ("eval", 32, 1)):
        (here / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(n, seed)))
