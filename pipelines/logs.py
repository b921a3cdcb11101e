"""Framework noise goes to a log file, not the terminal.

Ray, MLflow (and its alembic migrations), Dagster, transformers and Python warnings all
log INFO lines or banners of their own. `rlake train` sends every one of them to
`<output_dir>/logs/<name>.log`; `--verbose` also echoes them to stderr. Dagster's telemetry banner
is switched off in the instance's dagster.yaml instead (pipelines/runner.py), where Dagster reads it.

A run that fails prints one error line (`report_failure`): the error that the user acts on, taken out of
the Dagster step error and Ray task error around it (a reward function's names the rollout, its own
file:line and exception: stages.scored_rollouts.RewardFunctionError), without Ray's colour codes; the full
traceback goes to the log file. Dagster's console logger stays quiet (pipelines/runner.py QUIET): its step
failure events, 100+ lines each, are in the Dagster UI's run page.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
import warnings
from pathlib import Path

NOISY = (
    "ray",
    "ray.serve",
    "mlflow",
    "alembic",
    "dagster",
    "transformers",
    "torch",
    "urllib3",
    "filelock",
    "httpx",
    "py.warnings",
    "megatron",
    "vllm",
)
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# set before the libraries are imported: they read these once
QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_ACCEPT_CLOUD_SDK_WARNING": "1",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_CONFIGURE_LOGGING": "false",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    "TQDM_DISABLE": "1",
}


def quiet_env() -> None:
    """Environment switches that keep libraries (and the Ray workers, which inherit them) quiet."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def route_framework_logs(log_file: Path, *, verbose: bool = False) -> Path:
    """Send the NOISY loggers and Python warnings to log_file (and stderr when verbose); returns the file.

    The handlers sit on the root logger and the NOISY loggers lose their own console handlers and
    propagate to it: libraries attach console handlers on import (ray, mlflow), and
    `ray.init` strips the `ray` logger's handlers again, after which its records also reach root
    (without a root handler Python's last-resort handler would print them)."""
    quiet_env()
    # imported after quiet_env(), whose variables they read on import: mlflow attaches its handlers unless
    # MLFLOW_CONFIGURE_LOGGING=false, ray configures its loggers
    import mlflow  # noqa: F401, PLC0415 - after quiet_env()
    import ray  # noqa: F401, PLC0415 - after quiet_env()

    log_file.parent.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(log_file)]
    if verbose:
        handlers.append(logging.StreamHandler())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        h.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(h)
    root.setLevel(logging.INFO)
    for name in NOISY:
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.propagate = True
        logger.setLevel(logging.WARNING if name == "torch" else logging.INFO)  # torch's INFO: cache stats at exit
    logging.captureWarnings(True)
    warnings.simplefilter("default")  # each distinct warning once, into py.warnings -> the file
    return log_file


MESSAGE_ERRORS = (ValueError, FileNotFoundError, FileExistsError)
"""rlake's what / why / fix errors (bad input, a failed reward function): shown as their message, exit status 2."""
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_WRAPPER_MODULES = ("ray.", "dagster.", "dagster_")


def root_error(exc: BaseException) -> BaseException:
    """The error the user acts on: `exc` without the wrappers the frameworks put around it (a Ray task's
    RayTaskError -> the task's own exception, its `cause`; a Dagster step or user-code error -> the user code's)."""
    seen: set[int] = set()
    while id(exc) not in seen and type(exc).__module__.startswith(_WRAPPER_MODULES):
        seen.add(id(exc))
        inner = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError
        if not isinstance(inner, BaseException):
            inner = getattr(exc, "user_exception", None) or exc.__cause__  # dagster's wrappers
        if not isinstance(inner, BaseException):
            break
        exc = inner
    return exc


def failure_message(exc: BaseException) -> str:
    """What failed, for the error line: an rlake error's own message, else `Type: message (at file:line)` of
    the innermost frame; colour codes removed."""
    root = root_error(exc)
    text = _ANSI.sub("", str(root)).strip()
    if isinstance(root, MESSAGE_ERRORS):
        return text
    frames = traceback.extract_tb(root.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(root).__name__}: {text}{where}"


def report_failure(command: str, exc: BaseException, log_file: Path | None) -> int:
    """Log `exc` with its full traceback to the log file (logger `rlake`), print `rlake <command>: error: ...`
    and where the traceback is to stderr; returns the exit status (2: an rlake error, 1: anything else)."""
    logging.getLogger("rlake").error("rlake %s failed", command, exc_info=exc)
    print(f"rlake {command}: error: {failure_message(exc)}", file=sys.stderr)
    if log_file is not None:
        print(f"  (full traceback: {log_file})", file=sys.stderr)
    return 2 if isinstance(root_error(exc), MESSAGE_ERRORS) else 1
