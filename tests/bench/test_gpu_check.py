"""The CPU-checkable parts of bench/gpu_check.py: arguments, the no-CUDA stop, FLOP counting and MFU, the
markdown report. (Its sections need a CUDA GPU; docs/benchmarks.md says whether one was available.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = sys.modules.setdefault("gpu_check", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(gpu_check)


def test_arguments_default_to_every_section_and_a_workdir_beside_the_report(tmp_path: Path) -> None:
    args = gpu_check.parse_args(["--out", str(tmp_path / "r.md")])
    assert args.sections == list(gpu_check.SECTIONS) == ["rollout-vllm", "rollout-hf", "grpo", "passes", "megatron"]
    assert (args.prompts, args.n, args.max_tokens, args.peak_tflops) == (64, 8, 256, 989.0)
    assert args.workdir == f"{tmp_path / 'r.md'}.work" and args.section is None
    assert args.grpo_rollout == "vllm"  # the GPU config's engine; hf where the CUDA vllm build is absent
    assert gpu_check.parse_args(["--out", "r.md", "--grpo-rollout", "hf"]).grpo_rollout == "hf"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: --out"),
        (["--out", "r.md", "--prompts", "0"], "--prompts must be >= 1, got 0"),
        (["--out", "r.md", "--megatron-rollouts", "12"], "--megatron-rollouts must be a multiple of 8"),
        (["--out", "r.md", "--sections", "tpu"], "invalid choice: 'tpu'"),
        (["--out", "r.md", "--budget-s", "0"], "--peak-tflops and --budget-s must be > 0"),
        (["--out", "r.md", "--pass-budget", "512"], "--pass-budget must be >= 1024 tokens"),
    ],
)
def test_bad_arguments_stop_with_the_reason(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        gpu_check.parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_without_cuda_it_stops_saying_what_is_missing_and_how_to_install() -> None:
    with pytest.raises(SystemExit) as info:
        gpu_check.require_cuda(cuda_available=False)
    text = str(info.value.code)
    assert "needs a CUDA GPU" in text and "torch.cuda.is_available() is False" in text
    assert "pip install -e '.[vllm]'" in text
    assert gpu_check.require_cuda(cuda_available=True) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the stop on a machine without CUDA")
def test_the_script_fails_fast_on_this_cpu_machine(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr
    assert not out.exists() and not Path(f"{out}.work").exists()  # nothing converted, started or written


def test_matmul_params_are_the_linear_weights_of_the_model() -> None:
    # hand count: q, o 2*4*(2*2)=32; k, v 2*4*(1*2)=16; gated MLP 3*4*8=96 -> 144 per layer, x2 = 288; head 10*4
    config = LlamaConfig(
        hidden_size=4, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
        vocab_size=10, tie_word_embeddings=True,
    )  # fmt: skip
    arch = gpu_check.Arch.of(config)
    assert arch.matmul_params == 288 + 40 == 328
    linear = sum(m.weight.numel() for m in LlamaForCausalLM(config).modules() if isinstance(m, torch.nn.Linear))
    assert arch.matmul_params == linear  # the tied LM head counts: its matmul runs


def test_smollm2_135m_counts_134_5m_matmul_weights() -> None:
    config = LlamaConfig(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
        vocab_size=49152, tie_word_embeddings=True,
    )  # fmt: skip
    # 30 x (2*576*576 + 2*576*192 + 3*576*1536) + 49152*576 = 106,168,320 + 28,311,552
    assert gpu_check.Arch.of(config).matmul_params == 134_479_872


def test_update_flops_and_mfu_by_hand() -> None:
    arch = gpu_check.Arch(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, ffn=8, vocab=10)  # N = 328
    # forward of T=3 tokens: 3 x (2*328 + 4*2*4*3) = 3 x 752 = 2256; training = 3x forward
    assert gpu_check.update_flops(arch, [3]) == 6768.0
    assert gpu_check.update_flops(arch, [3], forward_passes=1) == 2256.0 * 4  # + the old log-prob forward
    assert gpu_check.update_flops(arch, [3, 3], epochs=2) == 2 * 2 * 6768.0  # additive over rows and epochs
    assert gpu_check.mfu(989e12, 1.0, 989.0) == pytest.approx(1.0)
    assert gpu_check.mfu(989e12, 4.0, 989.0) == pytest.approx(0.25)


def test_the_report_is_an_environment_list_and_a_markdown_table(tmp_path: Path) -> None:
    rows = [
        {"check": "rollout tokens/s, vllm", "result": "12,345", "detail": "a | b\nc"},
        {"check": "megatron", "result": "FAILED"},
    ]
    path = gpu_check.write_report(tmp_path / "sub" / "r.md", rows, {"GPU": "H200", "torch": "2.13.0"})
    assert path.read_text() == (
        "# rlake device check\n\n- GPU: H200\n- torch: 2.13.0\n\n"
        "| check | result | detail |\n|---|---|---|\n"
        "| rollout tokens/s, vllm | 12,345 | a \\| b c |\n"
        "| megatron | FAILED |  |\n"
    )


def test_each_section_runs_in_its_own_process_and_a_failure_is_a_row_saying_why(tmp_path: Path) -> None:
    # real child processes of the script: on this machine each stops at its own CUDA check
    argv = ["--out", str(tmp_path / "r.md"), "--sections", "rollout-hf", "megatron"]
    rows, failed = gpu_check.run_sections(gpu_check.parse_args(argv), argv)
    assert failed and [(r["check"], r["result"]) for r in rows] == [("rollout-hf", "FAILED"), ("megatron", "FAILED")]
    for row, section in zip(rows, ("rollout-hf", "megatron"), strict=True):
        assert "needs a CUDA GPU" in row["detail"] and f"{section}.log" in row["detail"]
        assert "needs a CUDA GPU" in (tmp_path / "r.md.work" / f"{section}.log").read_text()


def test_sections_past_the_budget_are_reported_not_run(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path / "r.md"), "--sections", "grpo", "--budget-s", "5"]
    rows, failed = gpu_check.run_sections(gpu_check.parse_args(argv), argv)
    assert failed and rows == [{"check": "grpo", "result": "not run", "detail": "--budget-s 5 spent"}]


def test_per_stage_rows_host_against_device_seconds() -> None:
    """The passes section's timing and row: off CUDA the CPU path times the host only (device None); a row gives
    host s, device s and share, MFU over the measured and the nominal peak, tokens/s and the padding share."""
    out, host, dev = gpu_check.device_timed(lambda: 7, torch.device("cpu"))
    assert (out, dev) == (7, None) and host >= 0
    # 2e12 FLOP in 2 s = 1 TFLOP/s: 1% of a measured 100, 0.1% of 1000; 3000 tokens / 2 s = 1,500 tokens/s
    row = gpu_check._pass_row("update, padded", 2.0, 0.5, 2e12, 100.0, 1000.0, 3000, 0.25, "padded")
    assert row == {
        "check": "update, padded, host s",
        "result": "2.00",
        "detail": "device 0.50 s (25% of host); MFU 1.0% of measured, 0.1% of 1000; 1,500 tokens/s; padding 25%",
    }
    assert "device n/a" in gpu_check._pass_row("x", 1.0, None, 1.0, 1.0, 1.0, 1, 0.5, "packed")["detail"]
