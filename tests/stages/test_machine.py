"""stages.run.machine: the CPU line every table of numbers carries (model name + widest vector ISA)."""

from __future__ import annotations

import os

from stages.run.machine import cpu_description, cpu_flags, cpu_model, vector_isa

# two cores of an AVX2-only AMD EPYC (no avx512*), as /proc/cpuinfo lists them
AVX2_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx avx2 fma bmi2
processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx avx2 fma bmi2
"""


def test_model_and_flags_come_from_the_first_cpu() -> None:
    assert cpu_model(AVX2_EPYC) == "AMD EPYC"
    assert cpu_flags(AVX2_EPYC) == {"fpu", "sse", "sse2", "avx", "avx2", "fma", "bmi2"}


def test_vector_isa_names_the_widest_instructions() -> None:
    assert vector_isa({"avx", "avx2"}) == "AVX2"
    assert vector_isa({"avx2", "avx512f"}) == "AVX-512"
    assert vector_isa({"avx2", "avx512f", "avx512_bf16"}) == "AVX-512 with bf16"
    assert vector_isa({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}) == "AMX"
    assert vector_isa({"sse2", "avx"}) == "no AVX2"
    assert vector_isa(set()) == ""  # no flags known (not Linux): say nothing rather than guess


def test_description_tells_two_same_named_cpus_apart() -> None:
    avx512 = AVX2_EPYC.replace("avx2 fma", "avx2 avx512f avx512_bf16 fma")
    assert cpu_description(AVX2_EPYC) == f"AMD EPYC (AVX2), {os.cpu_count()} cores"
    assert cpu_description(avx512) == f"AMD EPYC (AVX-512 with bf16), {os.cpu_count()} cores"


def test_without_cpuinfo_the_model_falls_back_and_the_isa_is_left_out() -> None:
    assert cpu_model("") != ""
    assert "(" not in cpu_description("").split(",")[0]
