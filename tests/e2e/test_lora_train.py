"""LoRA RL end to end: configs/ci_tiny_lora.yaml (ci_tiny + actor.lora.rank=8) trains 2 iterations through the real
pipeline (HF rollouts synced in place, torch trainer over Ray); its checkpoints hold merged weights plus the adapter
and its base, the policy moves only through the adapted layers, the optimizer state is the adapters' alone, a
trainer rank resumes from a checkpoint (base + adapter, not the merged weights), and `rlake export` writes plain HF
weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from configs.schema import load_config
from stages.io.checkpoints import load_optimizer_state
from stages.models import lora
from stages.run.export import export_policy
from stages.workers.actor_worker import load_resident

pytestmark = [pytest.mark.slow, pytest.mark.ray]
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ci_tiny_lora.yaml"
RUN = "lora"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, ray_session) -> Path:
    from pipelines.runner import run_training

    out = tmp_path_factory.mktemp("lora") / "run"
    os.environ["DAGSTER_HOME"] = str(out / "dagster_home")
    try:
        run_training(
            str(CONFIG),
            [f"trainer.output_dir={out}", "trainer.test_freq=0", "ray.num_cpus=2"],
            run_id=RUN,
            log=lambda s: None,
        )
    finally:
        os.environ.pop("DAGSTER_HOME", None)
    return out / "checkpoints" / RUN


def test_checkpoints_hold_the_adapter_and_the_policy_moved_through_it(lora_run: Path) -> None:
    v0, v2 = (
        load_file(str(lora_run / "policy_v0" / "model.safetensors")),
        load_file(str(lora_run / "policy_v2" / "model.safetensors")),
    )
    base = json.loads((lora_run / "policy_v2" / lora.LORA_DIR / lora.BASE_FILE).read_text())
    assert (
        base["base_policy"] == str(lora_run / "policy_v0")
        and (lora_run / "policy_v2" / lora.LORA_DIR / "adapter_model.safetensors").is_file()
    )
    assert v0.keys() == v2.keys()
    moved = {n for n in v0 if not torch.equal(v0[n], v2[n])}
    assert moved and all(n.endswith("_proj.weight") for n in moved), moved  # all-linear adapters, nothing else
    assert torch.equal(v0["model.embed_tokens.weight"], v2["model.embed_tokens.weight"])
    adapter = load_file(str(lora_run / "policy_v2" / lora.LORA_DIR / "adapter_model.safetensors"))
    state = load_optimizer_state(lora_run / "policy_v2")["optimizer"]["state"]
    assert sorted(s["exp_avg"].numel() for s in state.values()) == sorted(t.numel() for t in adapter.values())


def test_a_rank_resumes_from_base_plus_adapter(lora_run: Path) -> None:
    cfg = load_config(CONFIG)
    res = load_resident(str(lora_run / "policy_v2"), cfg.actor.optim, lora=cfg.actor.lora)
    assert lora.is_lora(res.model) and res.lora_base["base_name"] == "policy_v0"
    merged = load_file(str(lora_run / "policy_v2" / "model.safetensors"))
    again = lora.merged_state_dict(res.model)
    assert all(torch.allclose(again[n], w, atol=1e-6) for n, w in merged.items())
    assert len(res.optimizer.state) == len(load_optimizer_state(lora_run / "policy_v2")["optimizer"]["state"])


def test_export_writes_plain_merged_hf_weights(lora_run: Path, tmp_path: Path) -> None:
    summary = export_policy(lora_run / "policy_v2", tmp_path / "export")
    assert lora.LORA_DIR in summary["skipped"] and not (tmp_path / "export" / lora.LORA_DIR).exists()
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    merged = load_file(str(lora_run / "policy_v2" / "model.safetensors"))
    assert all(torch.equal(exported[n], w) for n, w in merged.items())
