"""Weights in transparent huge pages (Linux), so that a decoding step streams them at the memory's speed.

A CPU decoding step reads every weight once, front to back. In 4 KiB pages that is a TLB miss
and a page walk every 4 KiB, and the hardware prefetchers stop at every page boundary; with
2 MiB pages neither happens. Linux gives huge pages to anonymous memory advised with
MADV_HUGEPAGE when transparent huge pages are "madvise" (the common default) or "always", which
torch's allocator does not ask for. So ``into_huge_pages`` copies the weights once, at load, into
one anonymous mapping so advised, 2 MiB aligned; everything else (other systems, "never", a
mapping refused) leaves the weights where they are. Measured on the 1.5B's Q4_K gate projection
streamed from memory, one row of activations: see README, "GGUF models on their stored blocks".
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
ALIGN = 4096  # each tensor starts on a page: no two share a cache line
MIN_BYTES = 1 << 16  # smaller tensors (norms, biases) are not worth a page of their own


def _tensors(w) -> list[torch.Tensor]:
    if isinstance(w, torch.Tensor):
        return [w]
    if dataclasses.is_dataclass(w):
        return [v for f in dataclasses.fields(w) if isinstance(v := getattr(w, f.name), torch.Tensor)]
    return []


def _replace(w, moved: dict[int, torch.Tensor]):
    if isinstance(w, torch.Tensor):
        return moved.get(id(w), w)
    if dataclasses.is_dataclass(w):
        changes = {f.name: moved[id(v)] for f in dataclasses.fields(w)
                   if isinstance(v := getattr(w, f.name), torch.Tensor) and id(v) in moved}
        return dataclasses.replace(w, **changes) if changes else w
    return w


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def into_huge_pages(weights: dict[str, object]) -> dict[str, object]:
    """The same weights (tensors, or dataclasses of tensors such as BlockWeight), the large CPU
    tensors copied into one huge-page mapping. A tensor seen twice (a tied head) is copied once."""
    if not supported():
        return weights
    seen: dict[int, torch.Tensor] = {}
    for w in weights.values():
        for t in _tensors(w):
            if t.device.type == "cpu" and t.is_contiguous() and t.numel() * t.element_size() >= MIN_BYTES:
                seen.setdefault(id(t), t)
    if not seen:
        return weights
    sizes = {k: -(-t.numel() * t.element_size() // ALIGN) * ALIGN for k, t in seen.items()}
    length = sum(sizes.values()) + HUGE_PAGE
    try:
        arena = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return weights
    address = ctypes.addressof(ctypes.c_char.from_buffer(arena))
    offset = -address % HUGE_PAGE  # the first tensor on a huge-page boundary
    moved = {}
    for k, t in seen.items():
        view = torch.frombuffer(arena, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)
        view.copy_(t)
        moved[k] = view
        offset += sizes[k]
    return {name: _replace(w, moved) for name, w in weights.items()}
