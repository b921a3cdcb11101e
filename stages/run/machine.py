"""The CPU a run's numbers came from: its model name and its widest vector instructions.

Two CPUs that print the same model name ("AMD EPYC") can round floats differently and run several times
apart: a SmolLM2 iteration took 186-192 s with AVX-512 and 489-537 s with AVX2 only, and the README's main-job
table differs between them (README). So every table of numbers names both.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_model(info: str | None = None) -> str:
    """The first `model name` of /proc/cpuinfo (or of `info`), else platform.processor()."""
    info = _read() if info is None else info
    names = (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name"))
    return next(names, "") or platform.processor() or "unknown CPU"


def cpu_flags(info: str | None = None) -> set[str]:
    """The instruction-set flags of the first CPU in /proc/cpuinfo (or in `info`); empty where there is none."""
    info = _read() if info is None else info
    return set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))


def vector_isa(flags: set[str]) -> str:
    """The widest vector/matrix instructions among `flags`: 'AMX', 'AVX-512 with bf16', 'AVX-512', 'AVX2' or
    'no AVX2' ('' when the flags are unknown, e.g. off Linux)."""
    if not flags:
        return ""
    for name, needs in (("AMX", "amx_tile"), ("AVX-512 with bf16", "avx512_bf16"), ("AVX-512", "avx512f")):
        if needs in flags:
            return name
    return "AVX2" if "avx2" in flags else "no AVX2"


def cpu_description(info: str | None = None) -> str:
    """'<model> (<vector ISA>), <n> cores', e.g. 'AMD EPYC (AVX2), 2 cores'."""
    info = _read() if info is None else info
    isa = vector_isa(cpu_flags(info))
    return f"{cpu_model(info)}{f' ({isa})' if isa else ''}, {os.cpu_count()} cores"


def _read() -> str:
    return CPUINFO.read_text() if CPUINFO.is_file() else ""
