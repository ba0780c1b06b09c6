"""A preallocated key/value cache, written by position.

Every sequence owns one *slot*: a row of ``max_len`` positions in each layer's key and value
tensors. A forward pass writes the keys and values of its new tokens at their positions; the
engine keeps each sequence's valid length. Discarding rejected draft tokens is therefore free: the
length moves back and the next pass overwrites those positions (gpt-fast's ``KVCache.update``,
nano-vllm's block manager). Nothing is ever copied or reallocated during decoding.
"""

from __future__ import annotations

import os

import torch

from quickdraft.errors import ConfigError
from quickdraft.models.config import ModelConfig

# Of the memory free once the weights are loaded, the KV cache may take all but this share (and at
# least HEADROOM_MIN_BYTES): the passes' activations, a draft model and its own cache, the server.
HEADROOM = 0.2
HEADROOM_MIN_BYTES = 512 * 2**20
LENGTH_STEP = 256  # a length chosen by memory is a multiple of this
# On a CPU, the KV cache a default length may take, at most: the cache is allocated whole (every
# slot's every position) and zeroed, so a 1.5B model's 32,768-token context for 8 sequences took
# 7.5 GB, 12 GB of resident memory with its draft's cache, most of it never used. vLLM's CPU backend
# defaults its KV space to 4 GiB (VLLM_CPU_KVCACHE_SPACE) for the same reason; so does this, and
# QUICKDRAFT_CPU_KV_SPACE (GiB) sets another, as --max-model-len asks for a length.
DEFAULT_CPU_KV_BYTES = 4 * 2**30
CPU_KV_SPACE_ENV = "QUICKDRAFT_CPU_KV_SPACE"


def cpu_kv_space() -> int:
    """Bytes a default length's KV cache may take on a CPU: QUICKDRAFT_CPU_KV_SPACE GiB, else 4 GiB."""
    raw = os.environ.get(CPU_KV_SPACE_ENV)
    if raw is None:
        return DEFAULT_CPU_KV_BYTES
    try:
        gib = float(raw)
    except ValueError:
        gib = -1.0
    if not gib > 0:
        raise ConfigError(f"{CPU_KV_SPACE_ENV} must be a positive number of GiB, got {raw!r}", CPU_KV_SPACE_ENV)
    return int(gib * 2**30)


class KVCache:
    """keys[layer], values[layer]: [num_slots (+ 1 spare), num_kv_heads, max_len, head_dim]."""

    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device="cpu",
                 spare_slot: bool | None = None):
        """``spare_slot``: one slot more than ``num_slots``, held by no sequence, where a CUDA graph's
        padding rows write their keys and values (models/decoder/graphs.py); None: on CUDA only."""
        if spare_slot is None:
            spare_slot = torch.device(device).type == "cuda"
        shape = (num_slots + int(spare_slot), config.num_kv_heads, max_len, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.num_slots = num_slots
        self.spare_slot = num_slots if spare_slot else None
        self.max_len = max_len
        self.graphs: dict = {}  # the CUDA graphs captured over this cache, by model and shape (graphs.py)

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_kv_heads, n, head_dim] for positions start .. start+n-1 of ``slot``."""
        n = k.shape[1]
        self.keys[layer][slot, :, start : start + n] = k
        self.values[layer][slot, :, start : start + n] = v

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` positions: two [num_kv_heads, length, head_dim] views."""
        return self.keys[layer][slot, :, :length], self.values[layer][slot, :, :length]

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Positions 0 .. length-1 of slot ``src`` into slot ``dst``, every layer (the prefix cache,
        engine/prefix_cache.py: a prefix held by a running sequence's slot, shared with a new one)."""
        if src == dst or length <= 0:
            return
        for cache in (*self.keys, *self.values):
            cache[dst, :, :length] = cache[src, :, :length]

    def keep_path(self, slot: int, start: int, nodes: list[int]) -> None:
        """After a token-tree pass wrote node i's keys and values at position start + i of
        ``slot``: move the accepted path's nodes (increasing, verify/tree.py's ``path``) to
        positions start, start + 1, ..., in every layer. One gather a layer, no recomputation;
        the other nodes' entries are left as garbage past the sequence's length, like rejected
        chain drafts."""
        if not nodes or nodes == list(range(len(nodes))):
            return  # already in place (a chain, or an accepted prefix of first children)
        src = torch.tensor(nodes, dtype=torch.long, device=self.keys[0].device) + start
        for cache in (*self.keys, *self.values):
            cache[slot, :, start : start + len(nodes)] = cache[slot, :, src]  # the gather copies first



def free_memory(device="cpu") -> int | None:
    """Bytes the KV cache could take on ``device`` now: /proc/meminfo's MemAvailable on the CPU
    (the loaded weights are already out of it), the CUDA driver's free memory on a GPU; None where
    neither says."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def fit_max_model_len(config: ModelConfig, requested: int | None, num_slots: int, dtype: torch.dtype,
                      device="cpu", free: int | None = None) -> tuple[int, str]:
    """The tokens a sequence may hold, and one line saying why: ``requested`` (--max-model-len) where
    the model and the memory allow it, else an error naming what it exceeds; None: the model's own
    context length (its max_position_embeddings), less where the cache of ``num_slots`` sequences
    would not fit in ``free`` bytes (``free_memory()`` after the weights are loaded) less the headroom."""
    context = config.max_position_embeddings
    slots = num_slots + int(torch.device(device).type == "cuda")  # the CUDA graphs' spare slot
    per_position = KVCache.bytes_per_token(config, dtype) * slots  # one position of every slot
    budget = None if free is None else max(0, free - max(HEADROOM_MIN_BYTES, int(free * HEADROOM)))
    fits = None if budget is None else budget // per_position
    space = f"{_size(budget)} free after the weights" if budget is not None else ""
    kv_space = cpu_kv_space() if requested is None and torch.device(device).type == "cpu" else None
    if kv_space is not None and (budget is None or budget > kv_space):
        budget, space = kv_space, f"the CPU KV space, {_size(kv_space)}"
        fits = budget // per_position
    if requested is not None:
        if requested > context:
            raise ConfigError(f"max_model_len {requested} is more than {config.name or 'the model'}'s context "
                              f"length, {context}", "max_model_len")
        if fits is not None and requested > fits:
            raise ConfigError(f"max_model_len {requested} needs {_size(requested * per_position)} of KV cache for "
                              f"{num_slots} sequences, and {_size(budget)} is free for it after the weights: "
                              f"lower max_model_len (at most {fits}) or max_num_seqs", "max_model_len")
        return requested, f"max model len {requested} (as given; the model allows {context})"
    if fits is None or fits >= context:
        return context, f"max model len {context} (the model's context)"
    length = fits // LENGTH_STEP * LENGTH_STEP if fits >= LENGTH_STEP else fits
    if length < 2:
        raise ConfigError(f"no room for a KV cache: {_size(budget)} free after the weights, and a position of "
                          f"{num_slots} sequences takes {per_position} bytes; lower max_num_seqs", "max_model_len")
    return length, (f"max model len {length} (KV memory: {space}, for {num_slots} sequences; "
                    f"the model allows {context}: --max-model-len asks for more)")
