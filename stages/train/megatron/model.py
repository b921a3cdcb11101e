"""Megatron-Core GPTModel built from a HF Llama / Qwen2 config (local spec, no TransformerEngine).

Mapping: RMSNorm (rms_norm_eps), SwiGLU MLP (gated_linear_unit + silu), RoPE with the HF
rope_theta, GQA (num_query_groups = num_key_value_heads), qkv bias for Qwen2 (or a Llama with
attention_bias), no other linear biases, tied or untied output layer. Dropout is 0 and every
fusion is off, so the model computes what the HF model computes (up to float rounding).
The vocabulary is padded to a multiple of the TP size; callers slice logits to hf vocab_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class HFArch:
    """The facts of a HF causal-LM config that the conversion and the model need."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tied: bool
    qkv_bias: bool

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp


def hf_arch(hf_config) -> HFArch:
    """Read an HFArch from a transformers LlamaConfig / Qwen2Config."""
    mtype = hf_config.model_type
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"Unsupported model_type '{mtype}' for the Megatron backend. "
            f"Valid: {list(SUPPORTED_MODEL_TYPES)}; use actor.strategy='torch'."
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act '{act}' is not supported; the Megatron backend maps SwiGLU (silu) only.")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type '{rope.get('rope_type')}' is not supported; only 'default' RoPE is mapped.")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return HFArch(
        model_type=mtype,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=float(theta),
        max_position_embeddings=hf_config.max_position_embeddings,
        tied=bool(hf_config.tie_word_embeddings),
        qkv_bias=mtype == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
    )


def check_parallel_sizes(arch: HFArch, tp: int, pp: int) -> None:
    """Raise ValueError when the model cannot be split TP x PP."""
    if arch.num_heads % tp or arch.num_kv_heads % tp:
        raise ValueError(
            f"tensor_model_parallel_size ({tp}) must divide num_attention_heads ({arch.num_heads}) "
            f"and num_key_value_heads ({arch.num_kv_heads}), because heads are split over TP ranks; "
            "pick a common divisor."
        )
    if arch.ffn_hidden_size % tp:
        raise ValueError(f"tensor_model_parallel_size ({tp}) must divide intermediate_size ({arch.ffn_hidden_size}).")
    if arch.num_layers % pp:
        raise ValueError(
            f"pipeline_model_parallel_size ({pp}) must divide num_hidden_layers ({arch.num_layers}), "
            "because every stage holds the same number of layers; pick a divisor."
        )


def transformer_config(arch: HFArch, tp: int, pp: int, dtype: torch.dtype = torch.float32):
    """The TransformerConfig of `arch` split TP x PP (CPU initialization, no fusions, no dropout)."""
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415 - optional extra

    check_parallel_sizes(arch, tp, pp)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        deallocate_pipeline_outputs=False,
        batch_p2p_sync=False,  # its torch.cuda.synchronize() guards a CUDA race; gloo has none
    )


def build_gpt_model(arch: HFArch, tp: int, pp: int, dtype: torch.dtype = torch.float32):
    """This rank's stage of the GPTModel (parallel_state must be initialized with the same TP/PP)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - optional extra
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415 - optional extra
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415 - optional extra

    config = transformer_config(arch, tp, pp, dtype)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=arch.padded_vocab(tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=False,
        share_embeddings_and_output_weights=arch.tied,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
    )
    return model
