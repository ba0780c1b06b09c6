"""GGUF file (llama.cpp's format) -> ModelConfig + float tensors with Hugging Face names + Tokenizer.

Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1, Q2_K .. Q6_K, IQ*), then cast to the requested dtype. Two layout facts:

* GGUF lists a tensor's dims fastest-first (ne0 = columns), so a torch weight of shape
  [out_features, in_features] is stored with shape [in, out]: we reverse the dims.
* For arch "llama", llama.cpp's converter reorders the rows of q_proj and k_proj so that rotary
  pairs are interleaved (GPT-J style, dims 2i and 2i+1), where Hugging Face's checkpoints rotate
  halves (dims i and i + head_dim/2). ``unpermute_rows`` undoes that, so one decoder reads both
  sources. Qwen2 files are written without the permutation.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import gguf.quants
import numpy as np
import torch
from tqdm import tqdm

from quickdraft.errors import ModelFormatError
from quickdraft.models.config import ModelConfig
from quickdraft.models.ggml import BLOCKS, BlockWeight
from quickdraft.models.tokenizer import Tokenizer

SUPPORTED_ARCHS = ("llama", "qwen2")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None for a tensor we do not know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k reordering: within each head, row ``j`` of the first half and row ``j`` of
    the second half become rows ``2j`` and ``2j+1``. w: [rows] or [rows, cols], rows = n_head * head_dim."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, -1).transpose(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of ``permute_rows``: interleaved rotary pairs back to rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """A memory-mapped reader; ModelFormatError if ``path`` is not a GGUF file we can parse."""
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise ModelFormatError(f"{path}: not a readable GGUF file ({e})") from e


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key-value field as a Python value (str, int, float, bool, or a list of those)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def config_from_metadata(
    meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], tokenizer: Tokenizer, source: str
) -> ModelConfig:
    """ModelConfig from ``{arch}.*`` metadata; ``tensor_shapes`` (GGUF name -> torch shape) decides
    tied embeddings (no ``output.weight``) and attention bias (``blk.0.attn_q.bias`` present)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelFormatError(f"{source}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")

    def get(key: str, default: Any = ModelFormatError) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is ModelFormatError:
            raise ModelFormatError(f"{source}: metadata key {arch}.{key} is missing")
        return value

    hidden, n_head = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_head))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelFormatError(f"{source}: partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    if get("rope.scaling.type", "none") not in ("none", None):
        raise ModelFormatError(f"{source}: rope scaling {get('rope.scaling.type')!r} is not supported")
    # The decoder's vocab_size is the embedding's row count; the token list (or {arch}.vocab_size)
    # may only be shorter (padded embeddings), never longer.
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else int(get("vocab_size"))
    embd_rows = tensor_shapes.get("token_embd.weight", (vocab,))[0]
    if embd_rows < vocab:
        raise ModelFormatError(f"{source}: token_embd.weight has {embd_rows} rows but the vocabulary has {vocab} tokens")
    return ModelConfig(
        arch=arch,
        vocab_size=embd_rows,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=n_head,
        num_kv_heads=int(get("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(meta.get("general.name") or Path(source).stem),
    )


def _torch_shape(t: gguf.ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def dequantize_tensor(t: gguf.ReaderTensor, source: str) -> torch.Tensor:
    """Tensor ``t`` as float32 with its torch shape ([out, in] for a weight matrix)."""
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ModelFormatError(f"{source}: tensor {t.name} has type {t.tensor_type.name}, which cannot be dequantized") from e
    if np.may_share_memory(arr, t.data):
        arr = arr.copy()  # F32 comes back as a view of the read-only memory map
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(_torch_shape(t))


def _as_blocks(t: gguf.ReaderTensor) -> BlockWeight | None:
    """The tensor as stored, if it is a matrix in a block format the kernels multiply."""
    shape = _torch_shape(t)
    if t.tensor_type.name not in BLOCKS or len(shape) != 2 or shape[1] % 64:
        return None
    return BlockWeight.from_gguf(t.tensor_type.name, t.data, shape)


def _convert(t: gguf.ReaderTensor, config: ModelConfig, dtype: torch.dtype, source: str,
             keep_blocks: bool) -> tuple[str, torch.Tensor | BlockWeight]:
    name = hf_name(t.name)
    if name is None:
        raise ModelFormatError(f"{source}: tensor {t.name} is not part of a {config.arch} model quickdraft knows")
    w = _as_blocks(t) if keep_blocks else None
    if w is None:
        w = dequantize_tensor(t, source).to(dtype)
    heads = {".q_proj.": config.num_heads, ".k_proj.": config.num_kv_heads}
    for part, n_head in heads.items():
        if config.arch == "llama" and part in name:
            if isinstance(w, BlockWeight):  # rows are independent: select repacks them in the new order
                w = w.select(unpermute_rows(torch.arange(w.shape[0]), n_head))
            else:
                w = unpermute_rows(w, n_head)
    return name, w


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True, keep_blocks: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor | BlockWeight], Tokenizer]:
    """Read a whole GGUF file: (config, {HF name: tensor in ``dtype`` on the CPU}, tokenizer).
    ``keep_blocks``: matrices in a block format the CPU kernels multiply (models/ggml.py) stay as
    stored, as BlockWeight; the rest is dequantized to ``dtype``."""
    source = str(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    tokenizer = Tokenizer.from_gguf_metadata(meta, source)
    shapes = {t.name: _torch_shape(t) for t in reader.tensors}
    config = config_from_metadata(meta, shapes, tokenizer, source)
    weights = dict(
        _convert(t, config, dtype, source, keep_blocks)
        for t in tqdm(reader.tensors, desc=f"{'repacking' if keep_blocks else 'dequantizing'} {Path(path).name}", unit="tensor", disable=not progress)
    )
    missing = [n for n in config.weight_names() if n not in weights]
    if missing:
        raise ModelFormatError(f"{source}: {len(missing)} tensors are missing, e.g. {missing[:3]}")
    return config, weights, tokenizer
