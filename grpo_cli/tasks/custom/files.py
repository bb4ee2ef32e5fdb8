"""The user's files of task=custom: relative paths made absolute before the run starts (so every rank, actor and
sweep job finds the same files), and the code's hashes recorded in run_info.json."""

from __future__ import annotations

from pathlib import Path

from grpo_cli.tasks.custom.schema import CustomTaskConfig, reward_specs
from grpo_cli.usercode.user_code import (
    absolute_reference,
    file_sha256,
    resolve_file,
    spec_reference,
    with_absolute_reference,
)


def absolutize_paths(task_cfg: CustomTaskConfig, base_dir: Path) -> None:
    """Make task=custom's relative paths absolute against `base_dir` (the directory grpo-run was started from) and
    record it as task.base_dir, in place, before the config is saved and sent to ranks, actors and sweep jobs."""
    if not task_cfg.base_dir:
        task_cfg.base_dir = str(base_dir)
    # task.base_dir, set by now; read as a key, not through reference_dir(): grpo-run's cli calls this on the
    # composed config (an OmegaConf node of the schema, without its methods) before it becomes the dataclass.
    base = Path(str(task_cfg.base_dir))
    task_cfg.train_path = _absolute_path(task_cfg.train_path, base)
    task_cfg.eval_path = _absolute_path(task_cfg.eval_path, base)
    task_cfg.cases_path = _absolute_path(task_cfg.cases_path, base)
    if (
        task_cfg.dataset
        and Path(base / str(task_cfg.dataset)).is_dir()
        and not Path(str(task_cfg.dataset)).is_absolute()
    ):
        task_cfg.dataset = str((base / str(task_cfg.dataset)).resolve())
    if task_cfg.generator:
        task_cfg.generator = absolute_reference(str(task_cfg.generator), base)
    for name, spec in reward_specs(task_cfg).items():
        task_cfg.rewards[name] = with_absolute_reference(spec, base)
    rm_path = task_cfg.reward_model.path
    if rm_path and (str(rm_path).startswith((".", "~")) or (base / str(rm_path)).is_dir()):
        task_cfg.reward_model.path = str(resolve_file(str(rm_path), base))


def _absolute_path(value: str | None, base: Path) -> str | None:
    """A relative path made absolute against `base`; an absolute one, or none, as it is."""
    if value and not Path(str(value)).expanduser().is_absolute():
        return str((base / str(value)).resolve())
    return value


def code_hashes(task_cfg: CustomTaskConfig) -> dict[str, dict[str, str]]:
    """run_info.json's record of the user's code: {config key: {"file", "sha256"}} of every reward function's and
    the generator's file, so a rerun can tell they changed."""
    base_dir = task_cfg.reference_dir()
    references = {f"task.rewards.{name}": spec_reference(spec) for name, spec in reward_specs(task_cfg).items()}
    if task_cfg.generator:
        references["task.generator"] = task_cfg.generator
    out = {}
    for key, reference in references.items():
        if reference is None:
            continue
        found = file_sha256(str(reference), base_dir)
        if found is not None:
            out[key] = {"file": found[0], "sha256": found[1]}
    return out
