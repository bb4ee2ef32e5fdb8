"""Which keys each job reads: the one table behind "no key silently ignored" (docs/config-contract.md).

A key set on the command line that the chosen job never reads would change nothing, and a user who set it believes
it did (`job=baseline_eval init_from=<run>` evaluated the untrained model). So every key of GRPOConfig is declared
here once, for every job: read, ignored by design (accepted: it changes nothing that job computes, e.g. logger.*
outside training), or refused with one line naming the job and what to use instead. tests/unit/config/
test_job_keys.py walks the schema: a key or a job added without a line here fails it.

Presets that set keys of several groups (experiment=, debug=, generation=, algorithm=, sweep=) are not checked:
they are composed defaults, not a key the user set for this job.
"""

from __future__ import annotations

from dataclasses import dataclass

# What each job does, as the refusal says it ("job=report compares finished runs ... and does not read ...").
JOB_SUMMARIES: dict[str, str] = {
    "train": "trains the policy",
    "baseline_eval": "evaluates the untrained model",
    "eval": "evaluates the trained model eval.model names",
    "export": "writes a run's checkpoint as a Hugging Face model folder (the run's own config)",
    "benchmark": "times training steps per rollout engine",
    "report": "compares finished runs from their files",
    "check_reward": "scores the task's reward on its cases (no model)",
}

_MODEL_JOBS = ("train", "baseline_eval", "eval", "benchmark")
_TRAINING = ("train", "benchmark")
_EVALUATING = ("train", "baseline_eval", "eval")
_NOT_TRAIN = ("baseline_eval", "eval", "export", "benchmark", "report", "check_reward")
_ONE_PROCESS = ("baseline_eval", "eval", "export", "report", "check_reward")
_FOR_EVAL = "use grpo-run job=eval eval.model=<run dir> to evaluate a trained run"


@dataclass(frozen=True)
class KeyUse:
    """One key's (or a whole group's) readers; `ignored`: jobs that accept it without reading it (by design)."""

    read_by: tuple[str, ...]
    ignored: tuple[str, ...] = ()


# A key is decided by its longest entry: `rollout.max_tokens` before `rollout`. A group choice on the command line
# (model=tiny_random) is refused only where the job reads none of that group's keys.
KEY_USES: dict[str, KeyUse] = {
    "model": KeyUse(_MODEL_JOBS),
    "model.name_or_path": KeyUse((*_MODEL_JOBS, "check_reward")),  # check_reward: the tokenizer of custom cases
    "task": KeyUse((*_MODEL_JOBS, "check_reward")),
    "rollout": KeyUse(_MODEL_JOBS),
    "rollout.max_tokens": KeyUse((*_MODEL_JOBS, "check_reward")),  # check_reward: the overlong term
    "loss": KeyUse(_TRAINING),
    "normalization": KeyUse(_TRAINING),
    "kl": KeyUse(_TRAINING),
    "sync": KeyUse(_TRAINING),
    "optim": KeyUse(_TRAINING),
    "train": KeyUse(_TRAINING),
    "train.steps": KeyUse((*_TRAINING, "check_reward")),  # check_reward: trainer_state.max_steps
    # The held-out examples training evaluates; the evaluating jobs take the same (job.n_examples first).
    "train.eval_examples": KeyUse(_EVALUATING),
    "train.eval_every": KeyUse(("train",)),
    "train.checkpoint_every": KeyUse(("train",)),
    "train.keep_checkpoints": KeyUse(("train",)),
    "logger": KeyUse(("train",), ignored=_NOT_TRAIN),
    "job.name": KeyUse(tuple(JOB_SUMMARIES)),
    "job.n_examples": KeyUse(("baseline_eval", "eval")),
    # What a run returns to a Hydra sweeper: jobs without an eval reward return nothing, whatever it says.
    "job.objective": KeyUse(_EVALUATING, ignored=("export", "benchmark", "report", "check_reward")),
    "job.engines": KeyUse(("benchmark",)),
    "job.warmup_steps": KeyUse(("benchmark",)),
    "job.steps": KeyUse(("benchmark",)),
    "job.precisions": KeyUse(("benchmark",)),
    "job.scaling": KeyUse(("benchmark",)),
    "job.scaling_batches": KeyUse(("benchmark",)),
    "job.scaling_max_tokens": KeyUse(("benchmark",)),
    "job.scaling_steps": KeyUse(("benchmark",)),
    "job.length_profile": KeyUse(("benchmark",)),
    "eval.n_samples": KeyUse(_EVALUATING),
    "eval.pass_k": KeyUse(_EVALUATING),
    "eval.model": KeyUse(("eval",)),
    "eval.step": KeyUse(("eval",)),
    "report": KeyUse(("report",)),
    # job=export's own; the end of a training run writes <run>/model/ with the same format keys.
    "export": KeyUse(("export",)),
    "export.merge_lora": KeyUse(("export", "train")),
    "export.dtype": KeyUse(("export", "train")),
    "export.max_shard_size": KeyUse(("export", "train")),
    "export.at_end": KeyUse(("train",)),
    # The jobs that run in one process, whatever distributed.* says (benchmark's long_tail profile runs ranks).
    "distributed": KeyUse(_TRAINING, ignored=_ONE_PROCESS),
    "seed": KeyUse(_MODEL_JOBS),
    "resume": KeyUse(("train",)),
    "init_from": KeyUse(_TRAINING),
    "output_dir": KeyUse(tuple(JOB_SUMMARIES)),
    "verbose": KeyUse(("train",), ignored=_NOT_TRAIN),
}

# What to use instead, where more can be said than "drop it": (job, key) -> the advice.
INSTEAD: dict[tuple[str, str], str] = {
    ("baseline_eval", "init_from"): _FOR_EVAL,
    ("baseline_eval", "resume"): _FOR_EVAL,
    ("baseline_eval", "eval.model"): "use grpo-run job=eval eval.model=...",
    ("baseline_eval", "eval.step"): "use grpo-run job=eval eval.model=<run dir> eval.step=...",
    ("eval", "init_from"): "name the run or checkpoint with eval.model=<run dir | checkpoint> instead",
    ("eval", "resume"): "name the run or checkpoint with eval.model=<run dir | checkpoint> instead",
    ("train", "job.n_examples"): "use train.eval_examples=... (the held-out examples each evaluation takes)",
    ("train", "eval.model"): "use init_from=<run dir> to train on from a run's weights, or job=eval to evaluate it",
    ("train", "eval.step"): "use init_from=<run dir>/checkpoints/step_N to train on from that checkpoint",
    ("train", "export.run"): "use grpo-run job=export export.run=<run dir>",
    ("eval", "export.run"): "use eval.model=<run dir>",
}

# Command-line groups that are presets over several groups: not checked (module docstring).
PRESET_GROUPS = ("experiment", "debug", "generation", "algorithm", "sweep")


def key_use(key: str) -> KeyUse | None:
    """The entry that decides `key` (its longest prefix in KEY_USES), None for a key no entry covers."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        use = KEY_USES.get(".".join(parts[:end]))
        if use is not None:
            return use
    return None


def job_accepts(job: str, key: str) -> bool:
    """Whether job `job` reads or deliberately ignores `key` (a dotted key, or a group set by a group choice)."""
    use = key_use(key)
    if use is None:
        return True  # hydra.* and keys outside the table (a task's own, checked by its schema)
    if job in use.read_by or job in use.ignored:
        return True
    # A group: accepted where the job reads any of its keys (model=... for check_reward's tokenizer).
    prefix = key + "."
    return any(k.startswith(prefix) and (job in u.read_by) for k, u in KEY_USES.items())


def readers_of(key: str) -> tuple[str, ...]:
    use = key_use(key)
    return use.read_by if use is not None else ()


def override_key(override: str) -> str:
    """The dotted key (or group) an override sets: `+a.b=1`, `++a.b=1`, `~a.b`, `a.b=1` all name a.b."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def unread_key_error(job: str, overrides: list[str]) -> str | None:
    """The one line refusing the first command-line override job `job` never reads, None when all are read."""
    for override in overrides:
        key = override_key(override)
        if key.startswith("hydra") or key in PRESET_GROUPS or job_accepts(job, key):
            continue
        readers = readers_of(key)
        instead = INSTEAD.get((job, key))
        if instead is None:
            jobs = ", ".join(f"job={name}" for name in readers)
            instead = f"it is read by {jobs}: drop it, or run one of those" if readers else "drop it"
        summary = JOB_SUMMARIES.get(job, "")
        return f"job={job} {summary} and does not read {key} ({override}): {instead}"
    return None


def markdown_table() -> str:
    """KEY_USES as docs/config-contract.md shows it (tests/unit/config/test_job_keys.py keeps the page equal)."""
    rows = ["| key (and the keys under it) | read by | accepted, not read (by design) |", "| --- | --- | --- |"]
    for key, use in KEY_USES.items():
        ignored = ", ".join(f"`{job}`" for job in use.ignored) or "-"
        rows.append(f"| `{key}` | {', '.join(f'`{job}`' for job in use.read_by)} | {ignored} |")
    return "\n".join(rows)
