"""`grpo-run`: the Hydra entrypoint. Composes and validates the config, then dispatches the job.

This is the only module that touches Hydra: it reads what it needs (output dir, the resolved config) once and
hands plain objects to the job functions: the config as the schema's GRPOConfig, typed from here to the kernel.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path
from typing import Any, NoReturn, cast

import hydra
from hydra.core.config_loader import ConfigLoader
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console

from grpo_cli import jobs
from grpo_cli.config import (
    GRPOConfig,
    register_configs,
    unknown_key_hint,
    validate_config,
)
from grpo_cli.config.group_choices import unknown_group_choice
from grpo_cli.config.job_keys import PRESET_GROUPS, unread_key_error
from grpo_cli.config.registry import HELP_TOPICS
from grpo_cli.config.resume import resumed_config
from grpo_cli.episodes import config as _episode_check  # noqa: F401 - registers the multi-turn keys' check
from grpo_cli.errors import (
    EXIT_INTERNAL_ERROR,
    EXIT_USER_ERROR,
    RunStopped,
    UserFacingError,
    error_summary,
    write_traceback,
)
from grpo_cli.tasks import absolutize_task_paths
from grpo_cli.tracking.report import run_objective

# HYDRA_FULL_ERROR=1 set by the user: tracebacks go to the terminal in full (main() sets it for itself too).
_full_error_asked = bool(os.environ.get("HYDRA_FULL_ERROR"))


def _fail(message: str) -> None:
    print(f"grpo-run: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def _check_output_dir(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        # A name of its own: the nodes of a multi-node run probe the same shared run directory at once.
        with tempfile.NamedTemporaryFile(dir=output_dir, prefix=".write_probe"):
            pass
    except OSError as e:
        raise UserFacingError(
            f"output directory {output_dir} is not writable ({e.strerror}): "
            "pass a writable output_dir=... or hydra.run.dir=..."
        ) from None


def sweep_subdir(job_num: int, override_dirname: str) -> str:
    """A multirun job's directory name: `3_optim.lr@1e-05+seed@1`, readable in `ls` and as a W&B run name.

    It must stay a valid unquoted override value (`resume=<dir>`, `report.runs=<dir>`), so the separators
    are @ and + (conf/config.yaml), not Hydra's usual = and , which its override parser rejects; any other
    character outside that set (a '/' that would nest directories, brackets of a list) becomes '_'.
    File names stop at 255 bytes.
    """
    name = f"{job_num}_{override_dirname}" if override_dirname else str(job_num)
    return re.sub(r"[^\w.+@%-]", "_", name)[:200]


def sweep_group_name(sweep_dir: str, preset: str | None) -> str:
    """The W&B group shared by every run of one multirun: the preset's name (if any) and the sweep directory."""
    return f"{preset or 'sweep'}-{Path(sweep_dir).name}"


def run_job(cfg: GRPOConfig, console: Console, overrides: list[str] | None = None) -> dict[str, Any]:
    """Validate, then run the job `job.name` names. Raises UserFacingError on bad input.

    overrides: the command-line overrides of this run (for the rerun command in run_info.json).
    """
    validate_config(cfg)
    output_dir = Path(cfg.output_dir)
    _check_output_dir(output_dir)
    return jobs.run_job(cfg.job.name, cfg, output_dir, console, overrides or [])


class SweepJobError(CompactHydraException):
    """A multirun job that stopped with a one-line error (already printed on its stderr). Raised, not sys.exit():
    Hydra records it as this job's failure and every launcher goes on with the other jobs; exit_code is what a
    single run would exit with, and the job's process exits with it under hydra/launcher=processes."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[type[SweepJobError], tuple[str, int]]:  # pickled back from a job process (submitit)
        return (type(self), (str(self), self.exit_code))


def _stop(line: str, message: str, exit_code: int, multirun: bool) -> NoReturn:
    print(line, file=sys.stderr)
    if multirun:
        raise SweepJobError(message, exit_code) from None
    sys.exit(exit_code)


def task(dict_cfg: DictConfig) -> float | None:
    """Hydra's task function: one run. Returns its objective (job.objective) for a sweeper, None for jobs without
    an eval reward. Module-level and undecorated, so job processes unpickle it by reference, importing this module
    (and with it the registrations at its end)."""
    console = Console(highlight=False, soft_wrap=True)
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        if multirun and dict_cfg.logger.group is None:
            dict_cfg.logger.group = sweep_group_name(hydra_cfg.sweep.dir, hydra_cfg.runtime.choices.get("sweep"))
        overrides = list(hydra_cfg.overrides.task)
        unread = unread_key_error(str(dict_cfg.job.name), overrides)  # no key silently ignored (config/job_keys.py)
        if unread is not None:
            raise UserFacingError(unread)
        # task=custom: the user's files, found from where grpo-run was started, in every process after this; on a
        # resume compared with the saved config's as what they resolve to (it holds them absolute).
        absolutize_task_paths(dict_cfg.task, task_base_dir(dict_cfg.task, Path(hydra_cfg.runtime.cwd)))
        if dict_cfg.resume:
            dict_cfg = resumed_config(
                dict_cfg.resume, Path(hydra_cfg.runtime.output_dir), overrides, console, composed=dict_cfg
            )
        if dict_cfg.job.name == "eval":  # the evaluated run's own config, the command line's keys on top
            from grpo_cli.jobs.eval import eval_config

            dict_cfg = eval_config(dict_cfg, overrides, Path(hydra_cfg.runtime.output_dir))
        # to_object resolves interpolations and checks types against the schema dataclasses: the config composed
        # under grpo_config_schema comes back as a GRPOConfig instance (OmegaConf's return type cannot say so).
        # From here on every job and component gets this typed object.
        try:
            cfg = cast(GRPOConfig, OmegaConf.to_object(dict_cfg))
        except OmegaConfBaseException as e:
            raise UserFacingError(_one_line(e)) from None
        output_dir = Path(cfg.output_dir)
        _check_output_dir(output_dir)
        if not cfg.resume:
            (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(dict_cfg, resolve=True))
        summary = run_job(cfg, console, overrides=overrides)
    except UserFacingError as e:
        _stop(f"grpo-run: error: {e}", str(e), EXIT_USER_ERROR, multirun)
    except RunStopped as e:
        _stop(stop_line(e), str(e), e.exit_code, multirun)
    except Exception as e:
        if multirun or _full_error_asked:  # a sweep job's process prints it; or asked for in full
            raise
        log = write_traceback(e, job_log_file() or Path(hydra_cfg.runtime.output_dir) / "grpo-run.log")
        _stop(internal_error_line(e, log), str(e), EXIT_INTERNAL_ERROR, multirun)
    return run_objective(cfg.job.objective, output_dir, summary)


def sweep_end_line(sweep_dir: str, app: str = "grpo-run", failed: bool = False) -> str:
    """The line a multirun ends with: where its runs are, and the command that compares them."""
    which = "the completed runs" if failed else "its runs"
    return f"{app}: sweep directory {sweep_dir}: compare {which} with {app} job=report report.runs={sweep_dir}"


class SweepEndLine(Callback):
    """Hydra's end-of-multirun hook (conf/config.yaml hydra.callbacks): prints sweep_end_line once the sweeper has
    run every job (a sweep with failed jobs ends with the launcher's summary, which prints it before)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        print(sweep_end_line(str(config.hydra.sweep.dir), str(config.hydra.help.app_name)), flush=True)


def task_base_dir(task_cfg: DictConfig, cwd: Path) -> Path:
    """Where a task's relative files are found: task.base_dir (made absolute against where grpo-run was started,
    and written back) when the task has it set, else where grpo-run was started. So an example's files (its data,
    rewards, tools, environment, agent) are found from any folder with task.base_dir=<the example's folder>."""
    base = task_cfg.get("base_dir")
    if not base:
        return cwd
    absolute = cwd / Path(str(base)).expanduser()
    task_cfg.base_dir = str(absolute)
    return absolute


def stop_line(stopped: RunStopped) -> str:
    """The line a run that stopped after saving its work ends with: `grpo-run: error: ...` when bad input stopped
    it (a reward or an environment that failed under task.on_reward_error=stop, exit code 2), as every user error
    reads; `grpo-run: ...` for a signal, diverging numbers or a failed weight sync."""
    return f"grpo-run: error: {stopped}" if stopped.exit_code == EXIT_USER_ERROR else f"grpo-run: {stopped}"


def job_log_file() -> Path | None:
    """The run directory's log that Hydra's job logging writes (<run dir>/<job name>.log), if any."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return Path(handler.baseFilename)
    return None


def internal_error_line(error: BaseException, log: Path) -> str:
    """The one line a bug ends with: what went wrong and where the traceback is, to report it."""
    return f"grpo-run: internal error: {error_summary(error)} (full traceback in {log})"


_hydra_main = hydra.main(version_base="1.3", config_path="conf", config_name="config")(task)


# Parts of Hydra/OmegaConf messages that are noise on one line (or wrong advice: schema keys cannot be added).
_HYDRA_NOISE = re.compile(
    r"\s*(full_key|reference_type|object_type)=?:?\s*(?:[\w.]*\[[^\]]*\]|\S+)|\s*To append to your config use \S+|"
    r"\s*Config search path:.*$",
    re.DOTALL,
)


def _one_line(error: BaseException) -> str:
    text = str(error)
    if error.__cause__ is not None and str(error.__cause__) not in text:
        text += f": {error.__cause__}"
    return " ".join(_HYDRA_NOISE.sub("", text).split())


def precheck_overrides(args: list[str]) -> None:
    """Compose the config of a single run before Hydra does, so a typo'd key (with the keys that node has), a
    wrong type, a missing value or an unknown choice fails with one line and exit code 2 (Hydra itself prints
    several lines and exits 1).

    Multirun, flags (--help, --cfg) and hydra.* overrides are left to Hydra, which handles them itself, except
    -m with --cfg, which Hydra answers with a traceback.
    """
    from hydra import compose, initialize_config_module

    flags = [arg.split("=", 1)[0] for arg in args if arg.startswith("-")]
    if {"-m", "--multirun"} & set(flags) and {"-c", "--cfg"} & set(flags):  # Hydra: a traceback
        _fail("--cfg shows one run's config: drop -m and give one value per key (grpo-run optim.lr=1e-5 --cfg job)")
    if flags:
        return
    overrides = [arg for arg in args if not arg.lstrip("+~").startswith("hydra")]
    try:
        with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
            OmegaConf.to_object(compose(config_name="config", overrides=[*overrides, "output_dir=."]))
    except (HydraException, OmegaConfBaseException) as e:
        _fail(config_error_line(e))


def config_error_line(error: BaseException) -> str:
    """The one line of a Hydra or OmegaConf error while composing: Hydra names the override (`Error merging
    override train.steps=ten: ...`); an unknown key gets the keys that node has (task=keyword's own, ...)."""
    hint = unknown_key_hint(error)
    suffix = f": {hint}" if hint else " (grpo-run --help lists every group and its choices)"
    return f"{_one_line(error)}{suffix}"


# Choices that need a Hydra plugin from an extra: (group, choice) -> (plugin module, extra).
PLUGIN_EXTRAS = {
    ("hydra/sweeper", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
    ("sweep", "lr_search"): ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
    ("hydra/launcher", "submitit_local"): ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    ("hydra/launcher", "submitit_slurm"): ("hydra_plugins.hydra_submitit_launcher", "slurm"),
}


def check_plugin_extras(args: list[str]) -> None:
    """A sweeper or launcher whose extra is missing stops with one line naming it (Hydra: several lines)."""
    for arg in args:
        group, _, value = arg.lstrip("+~").partition("=")
        needed = PLUGIN_EXTRAS.get((group, value))
        if needed and find_spec(needed[0]) is None:
            _fail(f'{arg} needs the [{needed[1]}] extra: pip install -e ".[{needed[1]}]"')


def hydra_loader_for(args: list[str]) -> tuple[ConfigLoader, str, list[str], bool] | None:
    """The ConfigLoader `grpo-run <args>` composes with, read from the command line as Hydra reads it (its own
    argument parser and search path: grpo-run's conf/, --config-path, --config-dir, search-path plugins), with the
    config name, the overrides and whether it is a multirun. None where Hydra answers without composing a run
    (--help, shell completion) or rejects the command line itself (it says why)."""
    import contextlib
    import io

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import (
        create_automatic_config_search_path,
        detect_calling_file_or_module_from_task_function,
        get_args_parser,
    )
    from hydra.core.config_search_path import SearchPathQuery

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed = get_args_parser().parse_args(args)
    except SystemExit:
        return None
    if parsed.help or parsed.hydra_help or parsed.shell_completion:
        return None
    # What hydra.main(config_path="conf") computes for the task function (hydra/_internal/utils.py, _run_hydra).
    calling_file, calling_module = detect_calling_file_or_module_from_task_function(task)
    search_path = create_automatic_config_search_path(calling_file, calling_module, parsed.config_path or "conf")
    if parsed.config_dir is not None:
        config_dir = Path(parsed.config_dir).absolute()
        if not config_dir.is_dir():
            return None  # Hydra: "Additional config directory ... not found"
        search_path.prepend("command-line", f"file://{config_dir}", anchor=SearchPathQuery(provider="schema"))
    return (
        ConfigLoaderImpl(config_search_path=search_path),
        parsed.config_name or "config",
        parsed.overrides,
        parsed.multirun,
    )


def check_group_choices(args: list[str]) -> None:
    """A group choice that does not exist (experiment=cs336_mathh, a value of -m algorithm=grpo,dapoo, one a
    preset names) stops with one line naming the group's choices, before a run directory or a job exists."""
    command = hydra_loader_for(args)
    if command is not None:
        line = unknown_group_choice(*command)
        if line is not None:
            _fail(line)


def check_sweep_preset(args: list[str]) -> None:
    """A sweep preset without -m would run one job with the defaults: it stops with one line instead (a preset
    that does not exist stops at check_group_choices)."""
    multirun = any(arg in ("-m", "--multirun") for arg in args)
    for arg in args:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "sweep" and value not in ("", "null") and not multirun:
            _fail(f"sweep={value} is a preset of values to sweep over: run it with -m (grpo-run -m sweep={value})")


# Hydra's options that take a value (`--config-name loss` names a config, not a group to show).
_HYDRA_VALUE_OPTIONS = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name"}
_HYDRA_VALUE_OPTIONS |= {"-cd", "--config-dir", "-i", "--info", "--experimental-rerun"}


def take_help_topics(args: list[str]) -> tuple[list[str], list[str]]:
    """(the groups `grpo-run --help <group> ...` asks for, the command line without them). Hydra reads a bare word
    as a broken override, so they come off before it does; a word that is no group (nor `all`) stops with one
    line naming the groups."""
    if not {"-h", "--help"} & set(args):
        return [], args
    from grpo_cli.config.reference import groups

    topics, rest = [], []
    known = (*groups(), *PRESET_GROUPS)
    for i, arg in enumerate(args):
        bare = not arg.startswith(("-", "+", "~")) and "=" not in arg
        if bare and (i == 0 or args[i - 1] not in _HYDRA_VALUE_OPTIONS):
            if arg not in (*known, "all"):
                _fail(f"grpo-run --help {arg}: no such group: give one of {', '.join(known)}, or all")
            topics.append(arg)
        else:
            rest.append(arg)
    return topics, rest


def preset_help(group: str, width: int = 100) -> str:
    """`grpo-run --help <group>` of a preset group (experiment, generation, ...): its choices, each with what its
    file's opening comment says. A preset sets keys of several groups, so it has no keys of its own to list."""
    import textwrap
    from importlib.resources import files

    lines = [f"== {group}: presets over several groups (grpo-run {group}=<name> --cfg job shows every key one sets) =="]
    entries = sorted((e for e in (files("grpo_cli.conf") / group).iterdir() if e.name.endswith(".yaml")), key=str)
    for entry in entries:
        comment = []
        for line in entry.read_text().splitlines():
            if not line.startswith("#"):
                break
            text = line.lstrip("#").strip()
            if not text.startswith("@package"):
                comment.append(text)
        # Its first sentence: what the preset is (the rest of the comment is how to run it and why).
        first = re.split(r"(?<=\.)\s+(?=[A-Z][a-z]|grpo-run)", " ".join(comment), maxsplit=1)[0] or "-"
        name = entry.name.removesuffix(".yaml")
        lines += textwrap.wrap(first, width, initial_indent=f"{name:<18}", subsequent_indent=" " * 18)
    return "\n".join(lines)


def main() -> None:
    global _full_error_asked
    topics, args = take_help_topics(sys.argv[1:])
    presets = [topic for topic in topics if topic in PRESET_GROUPS]
    if presets:  # printed here: Hydra's help shows a group's keys, and a preset has none of its own
        print("\n\n".join(preset_help(group) for group in presets))
        topics = [topic for topic in topics if topic not in PRESET_GROUPS]
        if not topics:
            sys.exit(0)
    if topics:
        HELP_TOPICS[:] = topics
        sys.argv[1:] = args
    check_plugin_extras(args)
    check_group_choices(args)
    check_sweep_preset(args)
    precheck_overrides(args)
    _full_error_asked = bool(os.environ.get("HYDRA_FULL_ERROR"))
    if _full_error_asked:  # asked for every traceback in full (a developer)
        _hydra_main()
        return
    # Every error reaches us instead of Hydra's printer (which adds a HYDRA_FULL_ERROR hint or a traceback) and
    # ends in one line. task() handles the run's own errors, so what arrives here is Hydra's or a sweep's:
    # a failed sweep ends with the launcher's one summary line, a bad override, group or plugin with one line.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_main()
    except CompactHydraException as e:
        from hydra_plugins.grpo_cli_launcher import process_launcher

        if isinstance(e, process_launcher.SweepJobsFailed):
            print(e, file=sys.stderr)  # "grpo-run: 2 of 3 sweep jobs failed, the others completed: #1 ..."
            sys.exit(EXIT_INTERNAL_ERROR)
        if isinstance(e, SweepJobError):  # a job's own error, from a launcher that stops at the first one
            print(f"grpo-run: error: {e}", file=sys.stderr)
            sys.exit(e.exit_code)
        _fail(f"{_one_line(e)} (grpo-run --help lists every group and its choices)")
    except (HydraException, OmegaConfBaseException) as e:
        _fail(f"{_one_line(e)} (grpo-run --help lists every group and its choices)")
    except OSError as e:  # Hydra creates the run directory (and .hydra/ in it) before the run starts
        where = e.filename or "the run directory"
        _fail(f"cannot create {where} ({e.strerror}): give a writable hydra.run.dir=... (hydra.sweep.dir=... with -m)")
    except ImportError as e:  # a launcher or sweeper plugin whose package is not installed
        _fail(f"a Hydra plugin cannot be imported ({_one_line(e)}): install it, or drop that hydra/... override")
    except Exception as e:
        log = write_traceback(e, Path(tempfile.gettempdir()) / f"grpo-run-{os.getpid()}.log")
        print(internal_error_line(e, log), file=sys.stderr)
        sys.exit(EXIT_INTERNAL_ERROR)
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)


def register() -> None:
    """What every process that composes grpo-run's config needs, done when this module is imported: the
    command's own process, and each job process a launcher starts (ours, submitit's), which imports this module
    when it unpickles the task function."""
    # transformers' per-load progress bars would drown our own output (set the variable to 0 to get them back).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    register_configs()
    # conf/config.yaml names multirun job directories with ${sweep_subdir:...}.
    OmegaConf.register_new_resolver("sweep_subdir", sweep_subdir, replace=True)


register()

if __name__ == "__main__":
    # `python -m grpo_cli.cli`: run the imported grpo_cli.cli, not this __main__ copy, so that the task function
    # job processes unpickle is grpo_cli.cli.task (a function of __main__ would be pickled by value, and a job
    # process would never import this module's registrations).
    from grpo_cli.cli import main as _main

    _main()
