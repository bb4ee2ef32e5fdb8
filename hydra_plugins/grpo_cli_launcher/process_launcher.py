"""`hydra/launcher=processes`: every job of a multirun in a new Python process, `n_jobs` at a time.

Hydra's basic launcher calls the task function of every job inside the one process that parsed the command line,
so memory, CUDA state, threads and module globals leak from one job into the next, and a crash that kills the
process ends the sweep. Here each job is pickled the way hydra-submitit-launcher pickles it (the job's composed
config, Hydra's context and singletons, the task function; with cloudpickle, since resolvers are closures) and run
by a fresh `python -m hydra_plugins.grpo_cli_launcher._job_process`: a new OS process per job, never a reused
worker. The job's JobReturn, with the task function's return value (a sweeper's objective), comes back through a
result file. Each job's stdout and stderr go to the console and to `job.log` in its job directory. A failed job
does not stop the others; when every job has ended, the failures are reported in one line and the sweep exits
non-zero.

Plugin discovery imports this module in every Hydra app: it imports nothing heavy at module level. No
`from __future__ import annotations`: the scan executes the module before it is in sys.modules, where
dataclasses cannot resolve string annotations.
"""

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.errors import CompactHydraException
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)

JOB_PROCESS_MODULE = "hydra_plugins.grpo_cli_launcher._job_process"
POLL_S = 0.1
# When the launcher itself fails, how long each running job gets to checkpoint after SIGTERM before SIGKILL.
STOP_GRACE_S = 60.0


@dataclass
class ProcessLauncherConf:
    _target_: str = "hydra_plugins.grpo_cli_launcher.process_launcher.ProcessLauncher"
    # Jobs running at the same time, each in its own new process (1: one after another).
    n_jobs: int = 1
    # Each job's console output (stdout and stderr), written in its job directory.
    log_file: str = "job.log"


ConfigStore.instance().store(group="hydra/launcher", name="processes", node=ProcessLauncherConf, provider="grpo_cli")


class JobFailed(CompactHydraException):
    """One job's failure as the launcher reports it: one line, and the exit code of its process."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[Any, ...]:  # pickled from the job process back to the launcher
        return (type(self), (str(self), self.exit_code))


class SweepJobsFailed(CompactHydraException):
    """The one summary line of a launch with failed jobs; Hydra prints it alone (a CompactHydraException)."""


class ProcessJobReturn(JobReturn):
    """A JobReturn whose failure is raised without Hydra's extra "Error executing job with overrides" line: the
    summary exception already names every failed job with its overrides (its job directory)."""

    @property
    def return_value(self) -> Any:
        if self.status == JobStatus.FAILED:
            raise self._return_value
        return JobReturn.return_value.fget(self)  # type: ignore[attr-defined]

    @return_value.setter
    def return_value(self, value: Any) -> None:
        self._return_value = value


@dataclass
class _Job:
    num: int
    overrides: list[str]
    config: DictConfig
    dir: Path
    process: subprocess.Popen[str] | None = None
    log: IO[str] | None = None
    pumps: list[threading.Thread] = field(default_factory=list)
    last_stderr_line: str = ""
    result: JobReturn | None = None
    error: str = ""
    exit_code: int | None = None


class ProcessLauncher(Launcher):
    def __init__(self, n_jobs: int = 1, log_file: str = "job.log") -> None:
        if int(n_jobs) < 1:
            raise ValueError(f"hydra.launcher.n_jobs={n_jobs}: give 1 or more jobs at a time")
        self.n_jobs = int(n_jobs)
        self.log_file = log_file
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None
        self._console_lock = threading.Lock()
        self._stop_signal: int | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs, each in a new process, {self.n_jobs} at a time")
        jobs = []
        for offset, overrides in enumerate(job_overrides):
            num = initial_job_idx + offset
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
            config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(config):
                config.hydra.job.id = num
                config.hydra.job.num = num
            jobs.append(_Job(num, list(overrides), config, _job_dir(config)))

        with tempfile.TemporaryDirectory(prefix="hydra-jobs-") as tmp:
            self._run(jobs, Path(tmp))
        returns = [self._job_return(job) for job in jobs]

        failed = [job for job in jobs if job.result is None or job.result.status != JobStatus.COMPLETED]
        app = str(self.config.hydra.help.app_name)
        if self._stop_signal is not None:
            name = signal.Signals(self._stop_signal).name
            not_started = [f"#{job.num}" for job in jobs if job.process is None]
            parts = [_failures(failed, self.log_file) or "every started job completed"]
            if not_started:
                parts.append(f"not started: {', '.join(not_started)}")
            print(f"{app}: sweep stopped by {name}: {'; '.join(parts)}", file=sys.stderr)
            sys.exit(128 + self._stop_signal)
        if failed and len(failed) < len(jobs):
            # The sweep ends with the failure line (no end-of-multirun hook runs): where the completed runs are first.
            print(
                f"{app}: sweep directory {sweep_dir}: compare the completed runs with {app} job=report "
                f"report.runs={sweep_dir}",
                flush=True,
            )
        if failed:
            summary = SweepJobsFailed(
                f"{app}: {len(failed)} of {len(jobs)} sweep jobs failed, the others completed: "
                f"{_failures(failed, self.log_file)}"
            )
            for job_return in returns:
                if job_return.status == JobStatus.FAILED:
                    job_return.return_value = summary
        return returns

    def _run(self, jobs: list[_Job], tmp: Path) -> None:
        """Start the jobs n_jobs at a time and wait for every started one to end. SIGINT / SIGTERM stop the
        launching; SIGTERM is passed on to the running jobs (Ctrl-C reaches them from the terminal already)."""
        pending, running = deque(jobs), []

        def request_stop(signum: int, _frame: Any) -> None:
            self._stop_signal = self._stop_signal or signum
            if signum == signal.SIGTERM:
                for job in running:
                    job.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]

        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while pending or running:
                while pending and len(running) < self.n_jobs and self._stop_signal is None:
                    job = pending.popleft()
                    self._start(job, tmp)
                    running.append(job)
                    if self._stop_signal == signal.SIGTERM:  # arrived while this job was starting
                        job.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
                if not running:
                    break
                time.sleep(POLL_S)
                for job in [j for j in running if j.process.poll() is not None]:  # type: ignore[union-attr]
                    self._finish(job, tmp)
                    running.remove(job)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            for job in running:  # an exception in this loop: no job outlives the launcher
                _stop_process(job.process)  # type: ignore[arg-type]
                self._finish(job, tmp)

    def _start(self, job: _Job, tmp: Path) -> None:
        import cloudpickle

        spec = {
            "hydra_context": self.hydra_context,
            "task_function": self.task_function,
            "config": job.config,
            "singleton_state": Singleton.get_state(),
        }
        spec_path = tmp / f"{job.num}.spec.pkl"
        with spec_path.open("wb") as f:
            cloudpickle.dump(spec, f)
        job.dir.mkdir(parents=True, exist_ok=True)
        job.log = (job.dir / self.log_file).open("a", encoding="utf-8", errors="replace")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if sys.stdout.isatty():  # jobs write to pipes: keep the terminal's width for their tables
            env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
        command = [sys.executable, "-m", JOB_PROCESS_MODULE, str(spec_path), str(tmp / f"{job.num}.result.pkl")]
        job.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="replace",
            env=env,
        )
        prefix = f"[#{job.num}] " if self.n_jobs > 1 else ""
        job.pumps = [
            threading.Thread(target=self._pump, args=(job, job.process.stdout, sys.stdout, prefix), daemon=True),
            threading.Thread(target=self._pump, args=(job, job.process.stderr, sys.stderr, prefix), daemon=True),
        ]
        for pump in job.pumps:
            pump.start()

    def _pump(self, job: _Job, stream: IO[str], console: IO[str], prefix: str) -> None:
        """Copy one output stream of a job, line by line, to its log file and to the console."""
        for line in stream:
            if console is sys.stderr and line.strip():
                job.last_stderr_line = line.strip()
            with self._console_lock:
                job.log.write(line)  # type: ignore[union-attr]
                job.log.flush()  # type: ignore[union-attr]
                console.write(prefix + line)
                console.flush()

    def _finish(self, job: _Job, tmp: Path) -> None:
        import cloudpickle

        assert job.process is not None
        job.exit_code = job.process.wait()
        for pump in job.pumps:
            pump.join()
        result_path = tmp / f"{job.num}.result.pkl"
        if result_path.exists():
            try:
                with result_path.open("rb") as f:
                    job.result = cloudpickle.load(f)
            except Exception as e:  # noqa: BLE001 - a result that cannot be read is that job's failure
                job.error = f"its result could not be read ({type(e).__name__}: {e})"
        if job.result is not None and job.result.status == JobStatus.FAILED:
            job.error = str(job.result._return_value)
        elif job.result is None and not job.error:
            if job.exit_code < 0:
                job.error = f"killed by {signal.Signals(-job.exit_code).name}"
            else:
                job.error = job.last_stderr_line or f"its process exited with code {job.exit_code}"
        if job.error:
            with self._console_lock:
                job.log.write(f"job #{job.num} failed (exit code {job.exit_code}): {job.error}\n")  # type: ignore[union-attr]
        job.log.close()  # type: ignore[union-attr]

    def _job_return(self, job: _Job) -> JobReturn:
        ret = ProcessJobReturn(overrides=job.overrides)
        if job.result is not None:
            ret.cfg, ret.hydra_cfg = job.result.cfg, job.result.hydra_cfg
            ret.working_dir, ret.task_name = job.result.working_dir, job.result.task_name
        if job.result is not None and job.result.status == JobStatus.COMPLETED:
            ret.status, ret.return_value = JobStatus.COMPLETED, job.result._return_value
        else:
            ret.status = JobStatus.FAILED
            ret.return_value = JobFailed(job.error or "not started", job.exit_code or 1)
        return ret


def _job_dir(config: DictConfig) -> Path:
    """The directory Hydra's run_job will give this job (the subdir may read hydra.job.*: resolve it as run_job
    does, with the job's own config as the current Hydra config)."""
    previous = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)
    try:
        return Path(os.path.abspath(os.path.join(str(config.hydra.sweep.dir), str(config.hydra.sweep.subdir))))
    finally:
        HydraConfig.instance().cfg = previous


def _failures(failed: list[_Job], log_file: str) -> str:
    """`#1 (exit 2) <error> [outputs/multirun/<time>/1_.../job.log]; #3 ...`"""
    if not failed:
        return "no job failed"
    return "; ".join(
        f"#{job.num}{f' (exit {job.exit_code})' if (job.exit_code or 0) >= 0 else ''} {job.error} "
        f"[{_shown(job.dir / log_file)}]"
        for job in failed
        if job.process is not None
    )


def _shown(path: Path) -> str:
    """A path as the user typed the sweep directory: relative when it is below the working directory."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _stop_process(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
