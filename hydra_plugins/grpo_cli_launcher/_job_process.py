"""One job of a `hydra/launcher=processes` sweep, in its own new process:
`python -m hydra_plugins.grpo_cli_launcher._job_process <spec.pkl> <result.pkl>`.

Unpickling the spec imports the task function's module (grpo-cli: grpo_cli.cli, whose import registers its
resolvers and environment defaults), then Hydra's singletons are restored and Hydra's own run_job runs the job:
same output directory, .hydra/ files, logging and callbacks as under any other launcher. The JobReturn is pickled
to <result.pkl>; a failure travels as a JobFailed (one line and an exit code), since an arbitrary exception may not
unpickle. The process exits with the job's exit code.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import cloudpickle
from hydra.core.singleton import Singleton
from hydra.core.utils import JobStatus, run_job, setup_globals
from hydra.errors import CompactHydraException

# The module, not its JobFailed: restoring Hydra's singletons rescans the plugins, which re-executes the module
# and so redefines the class; the launcher unpickles whatever the module holds then.
from hydra_plugins.grpo_cli_launcher import process_launcher


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path, "rb") as f:
        spec = cloudpickle.load(f)
    Singleton.set_state(spec["singleton_state"])
    setup_globals()
    ret = run_job(
        hydra_context=spec["hydra_context"],
        task_function=spec["task_function"],
        config=spec["config"],
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )
    exit_code = 0
    if ret.status == JobStatus.FAILED:
        error = ret._return_value
        exit_code = getattr(error, "exit_code", 1)
        if not isinstance(exit_code, int) or not 0 < exit_code < 256:
            exit_code = 1
        if isinstance(error, CompactHydraException):
            message = str(error)  # a one-line error the application has already printed
        else:
            traceback.print_exception(type(error), error, error.__traceback__)
            message = f"{type(error).__name__}: {error}"
        ret.return_value = process_launcher.JobFailed(" ".join(message.split()), exit_code)
    try:
        data = cloudpickle.dumps(ret)
    except Exception as e:  # noqa: BLE001 - e.g. a return value that cannot be pickled: that is the failure
        ret.status, exit_code = JobStatus.FAILED, 1
        ret.return_value = process_launcher.JobFailed(
            f"its return value cannot be pickled ({type(e).__name__}: {e})", exit_code
        )
        data = cloudpickle.dumps(ret)
    partial = Path(f"{result_path}.partial")
    partial.write_bytes(data)
    os.replace(partial, result_path)  # the launcher never reads half a result
    return exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
