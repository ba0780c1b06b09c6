"""GGUF file (llama.cpp's format) -> ModelConfig + float tensors with Hugging Face names + Tokenizer.

Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1, Q2_K .. Q6_K, IQ*), then cast to the requested dtype. Two layout facts:

* GGUF lists a tensor's dims fastest-first (ne0 = columns), so a torch weight of shape
  [out_features, in_features] is stored with shape [in, out]: we reverse the dims.
* For arch "llama" (Llama and Mistral), llama.cpp's converter reorders the rows of q_proj and
  k_proj so that rotary pairs are interleaved (GPT-J style, dims 2i and 2i+1), where Hugging
  Face's checkpoints rotate halves (dims i and i + head_dim/2). ``unpermute_rows`` undoes that, so
  one decoder reads both sources. Qwen2, Qwen3 and Gemma 3 files are written without the
  permutation (llama.cpp rotates them "NeoX" style).

Each family's tensor names and metadata keys are models/families.py's; rotary settings,
``rope_freqs.weight`` included, are models/rope.py's. A tensor or key the family does not use is an
error.
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
from quickdraft.models.config import EMBED_SCALE, ModelConfig
from quickdraft.models.families import BY_GGUF_ARCH, FAMILIES, Family
from quickdraft.models.rope import Rope, rope_from_gguf, whole_head_only
from quickdraft.models.ggml import BLOCKS, BlockWeight
from quickdraft.models.tokenizer import Tokenizer

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+'s per-frequency factors: read into the config, not a weight


def hf_name(name: str, family: Family = FAMILIES["llama"]) -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` in a ``family`` model (``blk.3.attn_q.weight``
    -> ``model.layers.3.self_attn.q_proj.weight``), or None for a tensor the family does not have."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    names = family.gguf_block_names()
    if m is None or m.group(2) not in names:
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


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
    meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], tokenizer: Tokenizer, source: str,
    rope_freqs: np.ndarray | None = None,
) -> ModelConfig:
    """ModelConfig from ``{arch}.*`` metadata as llama.cpp writes and reads it; ``tensor_shapes``
    (GGUF name -> torch shape) decides tied embeddings (no ``output.weight``) and attention bias
    (``blk.0.attn_q.bias`` present); ``rope_freqs``: the ``rope_freqs.weight`` tensor, if any."""
    arch = meta.get("general.architecture")
    if arch not in BY_GGUF_ARCH:
        raise ModelFormatError(f"{source}: architecture {arch!r} is not supported (supported: {', '.join(BY_GGUF_ARCH)})")
    family = BY_GGUF_ARCH[arch]

    def get(key: str, default: Any = ModelFormatError) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is ModelFormatError:
            raise ModelFormatError(f"{source}: metadata key {arch}.{key} is missing")
        return value

    for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's: not Gemma 3's arithmetic
        if get(key, None) is not None:
            raise ModelFormatError(f"{source}: {arch}.{key} is set: soft-capping is not supported")
    hidden, n_head = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_head))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ModelFormatError(f"{source}: {arch}.attention.value_length differs from key_length: not supported")
    num_layers = int(get("block_count"))
    rope = whole_head_only(rope_from_gguf(meta, arch, head_dim, rope_freqs, source), head_dim, source)
    window, types, local = int(get("attention.sliding_window", 0) or 0), (), None
    if window and arch == "llama":  # a Mistral file that states its window (llama.cpp's "llama" has none)
        family = FAMILIES["mistral"]
    if window and family.sliding == "layer_types":
        # llama.cpp's Gemma 3: every 6th layer global unless the file says otherwise, the sliding
        # ones at base 10,000 without scaling (llama-model.cpp's LLM_ARCH_GEMMA3)
        pattern = int(get("attention.sliding_window_pattern", 6))
        types = tuple("sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(num_layers))
        local = Rope(float(get("rope.freq_base_swa", 10000.0)), None, rope.rotary_dim)
    elif window and family.sliding == "none":
        raise ModelFormatError(f"{source}: {arch}.attention.sliding_window is set, and {family.name} has no sliding window")
    # The decoder's vocab_size is the embedding's row count; the token list (or {arch}.vocab_size)
    # may only be shorter (padded embeddings), never longer.
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else int(get("vocab_size"))
    embd_rows = tensor_shapes.get("token_embd.weight", (vocab,))[0]
    if embd_rows < vocab:
        raise ModelFormatError(f"{source}: token_embd.weight has {embd_rows} rows but the vocabulary has {vocab} tokens")
    bias = "blk.0.attn_q.bias" in tensor_shapes
    if bias != family.qkv_bias:
        raise ModelFormatError(f"{source}: a {family.name} model {'with' if bias else 'without'} q/k/v biases: not supported")
    # Gemma 3 27B scales its queries by hidden / heads, every other size by its head size (llama.cpp)
    scalar = hidden / n_head if family.name == "gemma3" and num_layers == 62 else None
    return ModelConfig(
        arch=family.name,
        vocab_size=embd_rows,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=n_head,
        num_kv_heads=int(get("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        rope_theta=rope.theta,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias=bias,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(meta.get("general.name") or Path(source).stem),
        rope_scaling=rope.scaling,
        rotary_dim=rope.rotary_dim,
        sliding_window=window,
        layer_types=types,
        local_rope_theta=local.theta if local is not None else None,
        query_pre_attn_scalar=scalar,
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
    family = config.family
    name = hf_name(t.name, family)
    if name is None:
        raise ModelFormatError(f"{source}: tensor {t.name} is not part of a {config.arch} model quickdraft knows")
    w = _as_blocks(t) if keep_blocks else None
    if w is None:
        w = dequantize_tensor(t, source)
        # Gemma's norms stay float32: llama.cpp's converter wrote them with their 1 added (families.py)
        if not (family.unit_offset_norms and name.endswith("norm.weight")):
            w = w.to(dtype)
    heads = {".q_proj.": config.num_heads, ".k_proj.": config.num_kv_heads}
    for part, n_head in heads.items():
        if family.gguf_qk_permuted and part in name:
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
    freqs = next((dequantize_tensor(t, source).numpy() for t in reader.tensors if t.name == ROPE_FREQS), None)
    config = config_from_metadata(meta, shapes, tokenizer, source, freqs)
    tensors = [t for t in reader.tensors if t.name != ROPE_FREQS]
    weights = dict(
        _convert(t, config, dtype, source, keep_blocks)
        for t in tqdm(tensors, desc=f"{'repacking' if keep_blocks else 'dequantizing'} {Path(path).name}", unit="tensor", disable=not progress)
    )
    if config.family.embed_scale:
        weights[EMBED_SCALE] = torch.tensor(config.hidden_size**0.5, dtype=dtype)
    missing = [n for n in config.weight_names() if n not in weights]
    if missing:
        raise ModelFormatError(f"{source}: {len(missing)} tensors are missing, e.g. {missing[:3]}")
    return config, weights, tokenizer
