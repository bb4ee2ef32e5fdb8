"""Write data/train.jsonl and data/eval.jsonl: MedCalc-Bench-style rows ("Patient Note", "Question",
"Ground Truth Answer", "Calculator Name"), each a short synthetic note and one of three calculators whose
formula computes the answer. Small and local, so the example runs offline on a CPU; the real MedCalc-Bench is
one line away (task.dataset=ncbi/MedCalc-Bench-v1.0, task.split=train, task.eval_split=test).

    python make_data.py      # deterministic: the committed files are what it writes
"""

import json
import random
from pathlib import Path


def bmi(rng):
    age, height, weight = rng.randint(20, 85), rng.randint(150, 195), rng.randint(45, 120)
    sex = rng.choice(["man", "woman"])
    note = (
        f"A {age}-year-old {sex} presents for a routine visit. Height {height} cm, weight {weight} kg. "
        "No acute complaints."
    )
    question = "What is the patient's body mass index (BMI)? Your answer should be in terms of kg/m²."
    return "Body Mass Index (BMI)", note, question, round(weight / (height / 100) ** 2, 3)


def mean_arterial_pressure(rng):
    age, sbp = rng.randint(25, 90), rng.randint(95, 180)
    dbp = rng.randint(55, min(110, sbp - 20))
    note = (
        f"A {age}-year-old patient is seen in clinic. Blood pressure is {sbp}/{dbp} mm Hg, heart rate "
        f"{rng.randint(55, 110)} beats per minute."
    )
    question = "What is the patient's mean arterial pressure in mm Hg?"
    return "Mean Arterial Pressure (MAP)", note, question, round((2 * dbp + sbp) / 3, 3)


def creatinine_clearance(rng):
    age, weight, creatinine = rng.randint(30, 85), rng.randint(50, 110), round(rng.uniform(0.6, 2.5), 1)
    female = rng.random() < 0.5
    note = (
        f"A {age}-year-old {'woman' if female else 'man'} weighing {weight} kg has a serum creatinine of "
        f"{creatinine} mg/dL."
    )
    question = "Using the Cockcroft-Gault equation, what is the patient's creatinine clearance in mL/min?"
    value = (140 - age) * weight / (72 * creatinine) * (0.85 if female else 1.0)
    return "Creatinine Clearance (Cockcroft-Gault Equation)", note, question, round(value, 3)


CALCULATORS = (bmi, mean_arterial_pressure, creatinine_clearance)


def rows(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, note, question, answer = rng.choice(CALCULATORS)(rng)
        out.append(
            {"Calculator Name": name, "Patient Note": note, "Question": question, "Ground Truth Answer": str(answer)}
        )
    return out


if __name__ == "__main__":
    for split, n, seed in (("train", 200, 0), ("eval", 32, 1)):
        path = Path(__file__).parent / "data" / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows(n, seed)))
        print(f"wrote {n} rows to {path}")
