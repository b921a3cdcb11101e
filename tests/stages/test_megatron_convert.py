"""HF <-> Megatron state-dict conversion: exact round trips, QKV/fc1 layouts, TP/PP sharding."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from configs.schema import TinyModelConfig
from stages.models.tiny import build_tiny_model
from stages.train.megatron.convert import hf_to_megatron, megatron_to_hf, tp_partition_dim
from stages.train.megatron.model import check_parallel_sizes, hf_arch

pytestmark = pytest.mark.megatron
TINY = TinyModelConfig(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    tie_word_embeddings=True,
)
VOCAB = 83  # odd on purpose: padded to 84 for TP=2


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg)


MODELS = {"qwen2_tied": lambda: build_tiny_model(TINY, VOCAB), "llama_untied": lambda: _llama(False)}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
def test_round_trip_exact(name: str, tp: int, pp: int) -> None:
    hf = MODELS[name]()
    arch = hf_arch(hf.config)
    sd = hf.state_dict()
    shards = {
        (t, p): hf_to_megatron(sd, arch, tp=tp, pp=pp, tp_rank=t, pp_rank=p) for t in range(tp) for p in range(pp)
    }
    back = megatron_to_hf(shards, arch, tp=tp, pp=pp)
    assert sorted(back) == sorted(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_qkv_interleaving_per_query_group() -> None:
    # 4 query heads, 2 KV groups, head_dim 16: group g holds [q_{2g}, q_{2g+1}, k_g, v_g] rows;
    # TP rank r holds group r. Checked on the bias (Qwen2 has one) with recognisable values.
    hf = MODELS["qwen2_tied"]()
    arch = hf_arch(hf.config)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    d = arch.head_dim
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.arange(4.0).repeat_interleave(d)  # head h -> h
    sd["model.layers.0.self_attn.k_proj.bias"] = torch.tensor([10.0, 11.0]).repeat_interleave(d)
    sd["model.layers.0.self_attn.v_proj.bias"] = torch.tensor([20.0, 21.0]).repeat_interleave(d)
    for r, expect in enumerate([[0, 1, 10, 20], [2, 3, 11, 21]]):
        bias = hf_to_megatron(sd, arch, tp=2, pp=1, tp_rank=r, pp_rank=0)[
            "decoder.layers.0.self_attention.linear_qkv.bias"
        ]
        assert bias.reshape(4, d)[:, 0].tolist() == expect


def test_fc1_is_gate_then_up_per_tp_rank() -> None:
    hf = MODELS["qwen2_tied"]()
    arch = hf_arch(hf.config)
    sd = hf.state_dict()
    gate, up = sd["model.layers.1.mlp.gate_proj.weight"], sd["model.layers.1.mlp.up_proj.weight"]
    # PP=2 over 4 layers: global layer 1 is local layer 1 of stage 0; global 3 is local 1 of stage 1
    for r in range(2):
        fc1 = hf_to_megatron(sd, arch, tp=2, pp=2, tp_rank=r, pp_rank=0)["decoder.layers.1.mlp.linear_fc1.weight"]
        torch.testing.assert_close(
            fc1, torch.cat([gate[r * 48 : (r + 1) * 48], up[r * 48 : (r + 1) * 48]]), rtol=0, atol=0
        )


def test_stage_contents_and_tied_copy() -> None:
    hf = MODELS["qwen2_tied"]()
    arch = hf_arch(hf.config)
    sd = hf.state_dict()
    first = hf_to_megatron(sd, arch, tp=2, pp=2, tp_rank=1, pp_rank=0)
    last = hf_to_megatron(sd, arch, tp=2, pp=2, tp_rank=1, pp_rank=1)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "decoder.final_layernorm.weight" in last and "embedding.word_embeddings.weight" not in last
    # vocab 83 padded to 84: rank 1 holds rows 42..83, the last of them a zero pad row
    torch.testing.assert_close(last["output_layer.weight"][:-1], sd["model.embed_tokens.weight"][42:], rtol=0, atol=0)
    assert not last["output_layer.weight"][-1].any()
    assert tp_partition_dim("decoder.layers.0.self_attention.linear_proj.weight") == 1
    assert tp_partition_dim("decoder.layers.0.input_layernorm.weight") is None
    one = hf_to_megatron(sd, arch, tp=1, pp=1, tp_rank=0, pp_rank=0)
    assert "output_layer.weight" not in one  # tied, one stage: the embedding is the output layer


def test_bad_parallel_sizes_name_the_fix() -> None:
    arch = hf_arch(MODELS["qwen2_tied"]().config)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_parallel_sizes(arch, 4, 1)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        check_parallel_sizes(arch, 1, 3)
