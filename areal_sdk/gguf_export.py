"""A Llama-family Hugging Face model directory as one GGUF file, for llama.cpp-based tools.

Covers the decoders llama.cpp runs as ``llama`` (Llama, SmolLM) and ``qwen2`` (Qwen2, Qwen2.5)
with a byte-level BPE tokenizer. The file holds what llama.cpp's own converter
(``convert_hf_to_gguf.py``) writes for these models: the hyperparameters, the vocabulary
with each token's type, the merges, the special tokens and the chat template, and the
tensors under GGUF names (``gguf.TensorNameMap``). Matrices are stored in the chosen dtype,
norms and biases in float32, as llama.cpp does. For ``llama``, the query and key
projections are permuted into the interleaved rotary layout llama.cpp expects (readers,
transformers' GGUF loader among them, permute them back).

>>> write_gguf(Path("runs/x/checkpoints/step-40"), Path("x.gguf"))     # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from areal_sdk.checkpoints import read_weights

# model_type -> (GGUF architecture, whether q/k are permuted for llama.cpp's rotary layout)
ARCHITECTURES = {"llama": ("LLAMA", True), "qwen2": ("QWEN2", False)}

# A byte-level BPE tokenizer's pre-tokenizer (tokenizer.json) -> llama.cpp's name for it.
_SMOLLM_PRE = [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "use_regex": True},
]


def write_gguf(
    model_dir: Path, out: Path, *, dtype: torch.dtype = torch.bfloat16, name: str | None = None
) -> Path:
    """Write the model of ``model_dir`` (a checkpoint or any HF directory) to ``out``;
    ``name`` is the file's ``general.name`` (default: the directory's name)."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    arch_name, permute_qk = _architecture(config)
    arch = getattr(gguf.MODEL_ARCH, arch_name)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _write_hparams(writer, config, name or model_dir.name, dtype)
    _write_vocab(writer, tokenizer, model_dir, config.vocab_size)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, tensor in sorted(read_weights(model_dir).items()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"{name} has no GGUF name for {config.model_type}")
        data = tensor.float()
        if permute_qk and name.endswith("self_attn.q_proj.weight"):
            data = _rotary_interleave(data, heads)
        elif permute_qk and name.endswith("self_attn.k_proj.weight"):
            data = _rotary_interleave(data, kv_heads)
        _add_tensor(writer, target, data, dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _architecture(config: Any) -> tuple[str, bool]:
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"GGUF export supports {', '.join(ARCHITECTURES)} models, not {model_type!r}"
        )
    if model_type == "llama" and (config.attention_bias or config.mlp_bias):
        raise ValueError("GGUF export supports Llama models without attention or MLP biases")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"GGUF export supports plain rotary embeddings, not {rope.get('rope_type')!r} scaling"
        )
    return ARCHITECTURES[model_type]


def _write_hparams(writer: Any, config: Any, name: str, dtype: torch.dtype) -> None:
    import gguf

    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(theta))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    file_types = {
        torch.bfloat16: gguf.LlamaFileType.MOSTLY_BF16,
        torch.float16: gguf.LlamaFileType.MOSTLY_F16,
        torch.float32: gguf.LlamaFileType.ALL_F32,
    }
    writer.add_file_type(file_types[dtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _pre_tokenizer_name(tokenizer: Any) -> str:
    """llama.cpp's name for how this byte-level BPE tokenizer splits text before merging."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if (spec.get("model") or {}).get("type") != "BPE":
        raise ValueError("GGUF export supports byte-level BPE tokenizers only")
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    shape = [
        {k: step.get(k) for k in ("type", "individual_digits", "use_regex") if k in step}
        for step in steps
    ]
    if shape == [{"type": "ByteLevel", "use_regex": True}]:
        return "gpt-2"
    if shape == _SMOLLM_PRE:
        return "smollm"
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel":
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        if steps[0].get("pattern", {}).get("Regex") == PRETOKENIZE_REGEX:
            return "qwen2"
    raise ValueError(f"GGUF export does not know this tokenizer's pre-tokenizer: {pre}")


def _write_vocab(writer: Any, tokenizer: Any, model_dir: Path, vocab_size: int) -> None:
    """Tokens with their types, merges, special token ids and the chat template, the way
    llama.cpp's converter writes a byte-level BPE vocabulary."""
    import gguf

    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:  # the embedding is padded past the tokenizer
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(
                gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED
            )
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens))
    if not special.merges:
        raise ValueError(f"{model_dir} has no BPE merges in tokenizer.json or merges.txt")
    special.chat_template = tokenizer.chat_template
    # Whether encoding adds BOS/EOS, as the tokenizer does it (llama.cpp's defaults differ).
    ids = tokenizer("a")["input_ids"]
    special.add_special_token["bos"] = (
        tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id
    )
    special.add_special_token["eos"] = (
        tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id
    )
    special.add_to_gguf(writer, quiet=True)
    writer.add_add_space_prefix(False)


def _rotary_interleave(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows from HF's half-split rotary order into llama.cpp's pairwise order."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _add_tensor(writer: Any, name: str, data: torch.Tensor, dtype: torch.dtype) -> None:
    import gguf

    array = data.numpy()
    if data.dim() == 1 or dtype == torch.float32:  # norms and biases stay float32
        writer.add_tensor(name, array.astype(np.float32))
    elif dtype == torch.float16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        bf16 = gguf.GGMLQuantizationType.BF16
        writer.add_tensor(name, gguf.quants.quantize(array, bf16), raw_dtype=bf16)
