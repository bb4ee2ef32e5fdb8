"""Resuming a run: which run `resume=` names, and its saved config with the overrides a resume may change.

A resumed run continues exactly as it started: every key that shaped its trajectory so far is read back from the
run's config.yaml, and an override that would change one stops with one line (start a new run from the
checkpoint's weights with init_from= instead).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from grpo_cli.config.fields import path_problem
from grpo_cli.config.saved import SavedConfigError, load_saved_config
from grpo_cli.errors import UserFacingError


def find_run_to_resume(resume: bool | str, new_run_dir: Path) -> Path:
    """resume=true: the newest run beside this one that has checkpoints; resume=<dir>: that run."""
    if resume is True:
        root = new_run_dir.parent
        runs = [p for p in root.glob("*/checkpoints") if p.parent != new_run_dir and any(p.glob("step_*"))]
        if not runs:
            raise UserFacingError(f"resume=true found no run with checkpoints under {root}: give resume=<run dir>")
        return max(runs, key=lambda p: p.stat().st_mtime).parent
    run_dir = Path(str(resume)).expanduser()
    problem = path_problem(str(resume), "run")  # the check GRPOConfig.resume declares
    if problem is not None:
        raise UserFacingError(f"resume={resume}: {problem}")
    return run_dir


# Keys a resume may change: how long the run goes on, how often it evaluates and saves, and how it reports. Every
# other key shaped the run's trajectory so far (optimizer, loss, task, model, batch shape, seed, ...): changing it
# is a new run from the checkpoint's weights (init_from=), never a silent half-and-half resume.
# distributed: a checkpoint has the one-process layout, so a run may resume on another number of ranks.
RESUME_SAFE_KEYS = (
    "train.steps",
    "train.eval_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "verbose",
    "logger",
    "distributed",
)
RESUME_SAFE_PREFIXES = ("logger.", "distributed.")
# Overrides that are not config changes of the run itself.
_RESUME_OWN_KEYS = ("resume", "output_dir")


def _override_key(override: str) -> str:
    """The dotted key (or group) an override sets: `+a.b=1`, `++a.b=1`, `~a.b` all name a.b."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def _resume_may_change(key: str) -> bool:
    return key in RESUME_SAFE_KEYS or key.startswith(RESUME_SAFE_PREFIXES)


def resumed_config(
    resume: bool | str,
    new_run_dir: Path,
    overrides: list[str],
    console: Console | None = None,
    composed: DictConfig | None = None,
) -> DictConfig:
    """The saved config of the run being resumed (so it continues exactly as it started), with the overrides a
    resume may change applied (RESUME_SAFE_KEYS, logger.*) and written back to its config.yaml.

    Any other override that changes a saved value stops with one line naming the key and how to branch a new run
    from the checkpoint instead (init_from=); one that repeats the saved value is accepted. `composed` is this
    command's own composition (overrides applied), where the overridden values are read. A damaged config.yaml
    (a kill mid-write, a full disk, a bad edit) is rebuilt from the copy Hydra saved when the run started
    (<run dir>/.hydra/config.yaml), with one message; without that copy it is a one-line error.
    """
    run_dir = find_run_to_resume(resume, new_run_dir)
    saved_path = run_dir / "config.yaml"
    try:
        saved = load_saved_config(saved_path)  # under that run's task and rollout schemas
    except SavedConfigError as damaged:
        saved = _config_from_hydra_copy(run_dir, damaged)
        saved_path.write_text(OmegaConf.to_yaml(saved, resolve=True))
        if console is not None:
            console.print(
                f"{saved_path} was damaged ({damaged.reason}): rewritten from {run_dir / '.hydra' / 'config.yaml'}",
                highlight=False,
                markup=False,
            )
    applied = []
    for override in overrides:
        key = _override_key(override)
        if key in _RESUME_OWN_KEYS:
            continue
        new = OmegaConf.select(composed, key, default=None) if composed is not None else _override_value(override)
        old = OmegaConf.select(saved, key, default=_ABSENT)
        if old is _ABSENT and not _resume_may_change(key):  # a group that sets keys across the config (debug=...)
            raise UserFacingError(
                f"{override}: resume= continues a run with its saved config, which {key}= cannot change; to train "
                f"on from its weights with {override}, start a new run: grpo-run init_from={run_dir} {override}"
            )
        if _resume_may_change(key):
            OmegaConf.update(saved, key, new, force_add=True)
            applied.append(override)
        elif changed := _changed_keys(key, _plain(new), _plain(old)):
            first, saved_value, given = changed[0]
            more = f" (and {len(changed) - 1} more key(s))" if len(changed) > 1 else ""
            raise UserFacingError(
                f"{override}: {first} cannot change on resume (the run continues with its saved {first}="
                f"{saved_value}; this command gives {given}){more}; to train on from its weights with {override}, "
                f"start a new run: grpo-run init_from={run_dir} {override} (add the run's other overrides; resume= "
                f"may change only {', '.join(RESUME_SAFE_KEYS)}, logger.*)"
            )
    if applied:
        saved_path.write_text(OmegaConf.to_yaml(saved, resolve=True))
    saved.output_dir = str(run_dir)
    saved.resume = True
    return saved


_ABSENT = object()


def _plain(value: object) -> object:
    """A config node or value as plain Python (so a changed group or list compares by content)."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


# Where grpo-run was started: only what the task's relative paths resolve against. The paths themselves are compared
# as what they resolve to (the command line's made absolute as the saved ones were: cli.task), so a resume started
# from another folder that names the same files is the same run.
_RESOLUTION_ONLY = ("task.base_dir",)


def _changed_keys(key: str, new: object, old: object) -> list[tuple[str, object, object]]:
    """The leaf keys under `key` whose values differ, as (dotted key, saved value, given value): a changed group
    (task=custom) names the key inside it that changed, not the whole group."""
    if isinstance(new, dict) and isinstance(old, dict):
        changed = []
        for name in [*old, *(k for k in new if k not in old)]:
            missing = "<not set>"
            changed += _changed_keys(f"{key}.{name}", new.get(name, missing), old.get(name, missing))
        return changed
    if new == old or key in _RESOLUTION_ONLY:
        return []
    return [(key, old, new)]


def _override_value(override: str) -> object:
    """The value of a `key=value` override, parsed as YAML (without a composed config to read it from)."""
    import yaml

    return yaml.safe_load(override.split("=", 1)[1]) if "=" in override else None


def _config_from_hydra_copy(run_dir: Path, damaged: SavedConfigError) -> DictConfig:
    """The run's config from Hydra's own copy (.hydra/config.yaml, written before the run started; its
    output_dir is still an interpolation, which resuming replaces). Else the one-line error of config.yaml."""
    copy = run_dir / ".hydra" / "config.yaml"
    if not copy.is_file():
        raise damaged
    try:
        saved = load_saved_config(copy)
    except SavedConfigError:
        raise damaged from None
    saved.output_dir = str(run_dir)
    return saved
