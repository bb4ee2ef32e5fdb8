"""Write data/train.jsonl and data/eval.jsonl: arithmetic with fractions in the format of trl-lib/DeepMath-103K
(a conversational `prompt` column and a `solution` column in LaTeX), since this folder runs offline.

    python make_data.py          # seeded: the same rows every time
"""

import json
import random
from fractions import Fraction
from pathlib import Path

INSTRUCTION = "Think step by step inside <think></think>, then give the final answer in \\boxed{}."


def latex(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def row(rng: random.Random) -> dict:
    a, b = Fraction(rng.randint(1, 9), rng.randint(2, 9)), Fraction(rng.randint(1, 9), rng.randint(2, 9))
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = f"What is {a} {op} {b}? Give the answer as a reduced fraction. {INSTRUCTION}"
    return {"prompt": [{"role": "user", "content": question}], "solution": latex(value)}


def main() -> None:
    rng = random.Random(0)
    folder = Path(__file__).parent / "data"
    folder.mkdir(exist_ok=True)
    for name, n in (("train", 200), ("eval", 16)):
        with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for _ in range(n):
                f.write(json.dumps(row(rng)) + "\n")


if __name__ == "__main__":
    main()
