"""Reward functions of your own, verl-compatible (reward.custom_reward_function: path, name, batched,
reward_kwargs), and the call and return-value contract they share with installed `rlake.rewards` scorers.

- Signature (verl's compute_score): `name(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`,
  called with keyword arguments; reward_kwargs are added to every call. extra_info is the dataset row's
  extra_info as a dict ({} when the row has none). With `batched: true` (verl's batch reward manager):
  `name(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)` with one list per argument,
  returning one result per row. Batched is chosen by the config flag, not guessed from the signature;
  a signature that fits the other form fails preflight with the flag to set.
- Return: a number, or a dict with a numeric "score" plus extra keys (verl's reward_extra_info). Each extra
  key becomes a scored_rollouts column of that name: a SQL-friendly identifier, not one of rlake's own
  columns, with a scalar value (number, bool, str or None) of one type across rows.
- `async def` works in both forms: the rows of a block are awaited concurrently on one event loop.
- Shipping: the driver reads the file's source once (`read_custom_reward`); the source text travels inside
  the picklable RewardStage, and each Ray worker process execs it once into a fresh module, so the file
  need not exist on other nodes. Imports of installed packages work; relative imports and sibling files of
  the reward file do not (the module has no package and its directory is not on sys.path).
- Version: `<file name>:<function>@<sha256 of the source text, 12 hex>`, the reward_version column; with
  reward_kwargs set, `+kwargs@<sha256 of their canonical JSON, 12 hex>` is appended, because the kwargs change
  the scores as much as the source does (`canonical_kwargs`: sorted keys, no spaces).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import linecache
import re
import sys
import traceback
import types
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: this module imports the standard library alone (check_custom_reward)
    from configs.schema import CustomRewardFunctionConfig

VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
"""The keyword arguments of every call (verl's compute_score)."""
BATCH_PARAMS = tuple(f"{p}s" for p in VERL_PARAMS)
"""The list arguments of a batched call (verl's BatchRewardManager)."""
_COLUMN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SCALARS = (bool, int, float, str)


class BatchShapeError(TypeError):
    """A batched reward function returned something other than one result per row."""


def source_version(where: str, function: str, source: str | bytes) -> str:
    """`<where>:<function>@<first 12 hex of sha256(source)>`: which code scored a row."""
    data = source.encode() if isinstance(source, str) else source
    return f"{where}:{function}@{hashlib.sha256(data).hexdigest()[:12]}"


def canonical_kwargs(kwargs: Mapping[str, Any]) -> str:
    """reward_kwargs as canonical JSON (sorted keys, no spaces): equal kwargs, equal text, whatever the order
    they were written in; a value JSON cannot hold (a YAML date) is written as its str()."""
    return json.dumps(kwargs, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


@dataclass(frozen=True)
class CustomReward:
    """A user reward function as its source text: picklable, so it ships to Ray workers on any node."""

    path: str
    """The file as configured (error messages and tracebacks name it)."""
    source: str
    name: str = "compute_score"
    batched: bool = False
    reward_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def version(self) -> str:
        """The reward_version column: the source's version, plus the reward_kwargs' hash when there are any."""
        version = source_version(Path(self.path).name, self.name, self.source)
        if not self.reward_kwargs:
            return version  # the same version as before reward_kwargs counted
        digest = hashlib.sha256(canonical_kwargs(self.reward_kwargs).encode()).hexdigest()[:12]
        return f"{version}+kwargs@{digest}"

    @property
    def label(self) -> str:
        """The reward_fn column: <file stem>.<function>."""
        return f"{Path(self.path).stem}.{self.name}"

    def function(self) -> Callable[..., Any]:
        """The function, from this process's module of the source (exec'd on first use)."""
        module = _module(self.path, self.source)
        fn = getattr(module, self.name, None)
        if not callable(fn):
            defined = sorted(
                k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__
            )
            raise ValueError(
                f"reward.custom_reward_function.name '{self.name}' is not a function defined in {self.path}, "
                f"so rlake has nothing to call; functions there: {defined}. Set reward.custom_reward_function.name "
                "to one of them (verl's default is compute_score)."
            )
        return fn


def read_custom_reward(cfg: CustomRewardFunctionConfig) -> CustomReward | None:
    """The configured function's source, read here (on the driver); None when reward.custom_reward_function.path
    is unset. cfg: a CustomRewardFunctionConfig."""
    if not cfg.path:
        return None
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        why = "is a directory" if path.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"reward.custom_reward_function.path '{cfg.path}' {why} (resolved: {path.resolve()}), so there is no "
            "reward function to load; point it at a Python file defining "
            f"{cfg.name}(data_source, solution_str, ground_truth, extra_info=None, **kwargs) (a relative path is "
            "taken from the directory rlake runs in)."
        )
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"reward.custom_reward_function.path '{cfg.path}' cannot be read as UTF-8 Python source ({exc}); "
            "save it as a UTF-8 .py file."
        ) from exc
    return CustomReward(str(path), source, cfg.name, cfg.batched, dict(cfg.reward_kwargs))


@lru_cache(maxsize=8)
def _module(path: str, source: str) -> types.ModuleType:
    """A fresh module holding `source` exec'd as file `path`, once per process and source text. The source is
    put into linecache, so tracebacks show its lines on a worker where the file does not exist."""
    name = "rlake_custom_reward_" + hashlib.sha256(source.encode()).hexdigest()[:12]
    code = compile(source, path, "exec")
    linecache.cache[path] = (len(source), None, source.splitlines(keepends=True), path)
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module  # dataclasses, pickling and typing look a module up by name
    try:
        exec(code, module.__dict__)  # running the user's reward file is the point
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def explain_error(reward: CustomReward, exc: BaseException) -> str:
    """Where running the file or the function failed: `path, line N: error` and the line (the caret under a
    syntax error); the innermost frame in the reward file."""
    if isinstance(exc, SyntaxError):
        text = (exc.text or "").rstrip("\n")
        caret = f"\n    {' ' * max(0, (exc.offset or 1) - 1 - (len(text) - len(text.lstrip())))}^" if text else ""
        return f"{reward.path}, line {exc.lineno}: SyntaxError: {exc.msg}\n    {text.strip()}{caret}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == reward.path]
    where = f"{reward.path}, line {frames[-1].lineno}" if frames else reward.path
    line = f"\n    {frames[-1].line}" if frames and frames[-1].line else ""
    return f"{where}: {type(exc).__name__}: {exc}{line}"


def load_custom_reward(reward: CustomReward) -> Callable[..., Any]:
    """The function of `reward` loaded as a Ray task will (exec'd source, named function, signature checked);
    a file that fails to import is a ValueError naming its line."""
    try:
        fn = reward.function()
    except ValueError:
        raise
    except Exception as exc:  # the user's file: SyntaxError, ImportError, NameError at import time, ...
        raise ValueError(
            f"reward.custom_reward_function.path '{reward.path}' fails to import: {explain_error(reward, exc)}\n"
            "rlake runs the file as a module in every process that scores rewards, so it must import cleanly; "
            f"fix the file (`python {reward.path}` shows the same error)."
        ) from None
    check_signature(fn, reward)
    return fn


def check_custom_reward(cfg: CustomRewardFunctionConfig) -> CustomReward | None:
    """Read and load the configured reward file (cfg: a CustomRewardFunctionConfig) as the workers will: a
    missing file, an import error, a missing function or a wrong signature is a what / why / fix error.
    Needs nothing but the standard library, so `rlake train` runs it before importing torch, Ray or Dagster:
    a broken reward file fails in about a second. (Preflight then calls the function once: probe_custom_reward.)"""
    reward = read_custom_reward(cfg)
    if reward is not None:
        load_custom_reward(reward)
    return reward


def _accepts(sig: inspect.Signature) -> tuple[set[str], bool]:
    """(names a keyword call can pass, whether **kwargs takes any other)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {n for n, p in sig.parameters.items() if p.kind in kinds}
    return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


def check_signature(fn: Callable[..., Any], reward: CustomReward) -> None:
    """A ValueError (what / why / fix) unless a keyword call with the form's arguments and reward_kwargs binds."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    named, var_kw = _accepts(sig)
    wanted, other = (BATCH_PARAMS, VERL_PARAMS) if reward.batched else (VERL_PARAMS, BATCH_PARAMS)
    where = f"{reward.path}: {reward.name}{sig}"
    missing = [p for p in wanted if p not in named and not var_kw]
    if missing:
        form = "batched (lists in, a list out)" if reward.batched else "per-row"
        fix = (
            f"set reward.custom_reward_function.batched={str(not reward.batched).lower()}"
            if all(p in named for p in other)
            else f"define it as def {reward.name}({', '.join(wanted)}=None, **kwargs)"
        )
        raise ValueError(
            f"{where} does not accept {missing}, but rlake calls a {form} reward function with the keyword "
            f"arguments {list(wanted)} (verl's contract); {fix}."
        )
    unknown = [k for k in reward.reward_kwargs if k not in named and not var_kw]
    given = set(wanted) | set(reward.reward_kwargs)
    required = [
        n
        for n, p in sig.parameters.items()
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in given
    ]
    if unknown or required:
        problem = f"takes no parameter {unknown} that reward_kwargs sets" if unknown else f"requires {required}"
        raise ValueError(
            f"{where} {problem}, but rlake passes only {list(wanted)} plus reward.custom_reward_function."
            "reward_kwargs; add the parameter (or **kwargs), give it a default, or set it in reward_kwargs."
        )


def parse_extra_info(value: Any) -> dict:
    """A row's extra_info as the dict verl passes: the prompts table's JSON text parsed, {} when absent."""
    if isinstance(value, Mapping):
        return dict(value)
    if value is None or type(value).__name__ == "NAType" or (isinstance(value, float) and value != value):
        return {}  # NAType: pandas' NA, how a null arrives in a batch Ray Data hands over (no pandas import here)
    if value == "":
        return {}
    parsed = json.loads(value)
    return parsed if isinstance(parsed, dict) else {"value": parsed}


def run_async(awaitable: Awaitable[Any]) -> Any:
    """Await in a fresh event loop: here, or in a helper thread when this thread already runs one."""

    async def main() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, main()).result()


def call_reward_fn(
    fn: Callable[..., Any], rows: list[dict], *, batched: bool = False, reward_kwargs: Mapping[str, Any] | None = None
) -> list[Any]:
    """Each row's return value, or the exception its call raised. rows: {data_source, solution_str,
    ground_truth, extra_info}. Batched: one call with lists; its exception, or a result that is not one item
    per row, is every row's. Per row: coroutine functions are awaited together, others called in turn."""
    reward_kwargs = reward_kwargs or {}
    if batched:
        try:
            out = fn(**{f"{p}s": [r[p] for r in rows] for p in VERL_PARAMS}, **reward_kwargs)
            out = run_async(out) if inspect.isawaitable(out) else out
            if isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__") or len(out) != len(rows):
                raise BatchShapeError(
                    f"a batched reward function returns one result per row (a list of {len(rows)}), "
                    f"got {type(out).__name__}" + (f" of {len(out)}" if hasattr(out, "__len__") else "")
                )
            return list(out)
        except Exception as exc:  # user code: every row of the call failed
            return [exc] * len(rows)
    if inspect.iscoroutinefunction(fn):

        async def one(row: dict) -> Any:
            try:
                return await fn(**row, **reward_kwargs)
            except Exception as exc:  # user code: this row failed
                return exc

        async def every() -> list[Any]:
            return list(await asyncio.gather(*(one(r) for r in rows)))

        return run_async(every())
    out = []
    for row in rows:
        try:
            value = fn(**row, **reward_kwargs)
            out.append(run_async(value) if inspect.isawaitable(value) else value)
        except Exception as exc:  # user code: this row failed
            out.append(exc)
    return out


def split_result(value: Any) -> tuple[float, dict[str, Any]]:
    """(score, extra keys) of a scorer's return value: a number, or a dict with a numeric "score"; a
    ValueError / TypeError says what is wrong with it."""
    extras: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(
                f"returned a dict without 'score' (keys {sorted(map(str, value))}); a reward function returns a "
                "number or a dict with the number under 'score' and extra keys beside it"
            )
        extras = {k: _scalar(k, v) for k, v in value.items() if k != "score"}
        value = value["score"]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(
            f"returned {type(value).__name__} {value!r:.60}; a reward function returns a number (int, float, "
            "bool) or a dict with a numeric 'score'"
        )
    score = float(value)
    if score != score or score in (float("inf"), float("-inf")):
        raise ValueError(f"returned non-finite {score}")
    return score, extras


def _scalar(key: Any, value: Any) -> Any:
    """An extra key's value checked (a column name, a scalar); numpy scalars become Python ones."""
    if not isinstance(key, str) or not _COLUMN_NAME.match(key):
        raise ValueError(
            f"returned extra key {key!r}, which is not a column name; extra keys become scored_rollouts "
            "columns, so use letters, digits and '_' (not starting with a digit)"
        )
    if hasattr(value, "item") and not isinstance(value, _SCALARS):
        value = value.item() if getattr(value, "ndim", 0) == 0 else value
    if value is not None and not isinstance(value, _SCALARS):
        raise TypeError(
            f"returned extra key '{key}' = {type(value).__name__} {value!r:.60}; extra keys become scored_rollouts "
            "columns, so their values are numbers, bools, strings or None (json.dumps a structure)"
        )
    return value


def check_extra_keys(keys: set[str], reserved: set[str], label: str) -> None:
    """A ValueError when extra keys would replace rlake's own columns (`reserved`)."""
    taken = sorted(keys & reserved)
    if taken:
        raise ValueError(
            f"reward function {label} returned extra keys {taken}, which are rlake's own scored_rollouts columns, "
            "so writing them would replace rlake's values; rename those keys in the returned dict."
        )


def extra_column(key: str, values: list[Any]) -> list[Any]:
    """One type per extra column: bools stay bools, numbers (bools among them) become floats, strings stay
    strings; a mix of strings and numbers is a ValueError. NaN (a row of another block without the key,
    after concatenation) counts as None."""
    values = [None if isinstance(v, float) and v != v else v for v in values]
    kinds = {type(v) for v in values if v is not None}
    if kinds <= {bool} or kinds <= {str}:
        return values
    if kinds <= {bool, int, float}:
        return [None if v is None else float(v) for v in values]
    raise ValueError(
        f"reward extra key '{key}' has values of types {sorted(k.__name__ for k in kinds)} across rows, but a "
        "column holds one type; return numbers, bools or strings for it in every row (or None)."
    )
