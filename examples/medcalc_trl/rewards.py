"""The reward functions of TRL's tutorial ("Reinforcement Learning Fine-Tuning with GRPO"), copied as written.

They follow TRL's convention, fn(completions, **kwargs) -> list of floats, and grpo-run calls them the way TRL's
GRPOTrainer does: prompts=, completions= and each column of the data as a keyword argument (references= is the
"Ground Truth Answer" column, renamed in conf/task/medcalc_trl.yaml).
"""

import re


def format_reward(completions, **kwargs):
    """
    r = 1.0 if the completion contains both <think>…</think> and <answer>…</answer>.
    Encourages structured output format.
    """
    pattern = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
    return [1.0 if isinstance(c, str) and pattern.search(c) else 0.0 for c in completions]


def exact_answer_reward(completions, references=None, **kwargs):
    """r = 1.0 if extracted <answer> matches reference exactly."""
    out = []
    for c, ref in zip(completions, references or []):
        if not isinstance(c, str):
            out.append(0.0)
            continue
        m = re.search(r"<answer>(.*?)</answer>", c, re.DOTALL)
        pred = m.group(1).strip() if m else ""
        out.append(1.0 if pred == (ref or "").strip() else 0.0)
    return out


def numeric_tolerance_reward(completions, references=None, atol=0.5, **kwargs):
    """r = 1.0 if extracted numeric answer is within atol of reference."""
    out = []
    for c, ref in zip(completions, references or []):
        try:
            pred_m = re.search(r"<answer>\s*([+-]?[0-9]*\.?[0-9]+)", c)
            ref_m = re.search(r"([+-]?[0-9]*\.?[0-9]+)", ref)
            if pred_m and ref_m:
                pred_v = float(pred_m.group(1))
                ref_v = float(ref_m.group(1))
                out.append(1.0 if abs(pred_v - ref_v) <= atol else 0.0)
            else:
                out.append(0.0)
        except Exception:
            out.append(0.0)
    return out
