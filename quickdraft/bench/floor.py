"""The floor: the fastest plain decoding this machine's memory allows.

Decoding one token at batch 1 reads every weight of the model once (the embedding only by one
row), and on a CPU that read, not the arithmetic, is what takes the time. So

    floor tokens/s = memory read bandwidth / weight bytes read per token

is an upper bound on plain decoding (KV-cache and activation reads, a few MB, are left out), and
``none``'s tokens/s over it says how much of the machine the decoder uses. Speculative methods
can pass it: one target pass reads the weights once and emits several tokens.

The bandwidth is measured the way the decoder reads: torch, with the decoder's thread count,
summing a float32 tensor much larger than the last-level cache, best of several passes.
"""

from __future__ import annotations

import time

import torch

from quickdraft.models.memory import Arena

L3_BYTES = 32 << 20  # this machine's last-level cache; the buffer is many times larger


def measure_bandwidth(size_mib: int = 512, repeats: int = 8, threads: int | None = None) -> dict:
    """Read bandwidth in bytes/s: best of ``repeats`` timed sums over a ``size_mib`` buffer."""
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    # in huge pages where there are any, as the loader places the weights (models/memory.py): in
    # 4 KiB pages the probe read ~27 GB/s where the kernels stream the weights at ~35
    arena = Arena.create([size_mib << 20])
    try:
        if arena is not None:
            x = arena.take(torch.float32, (size_mib << 18,)).fill_(1.0)
        else:
            x = torch.ones(size_mib << 18, dtype=torch.float32)  # size_mib MiB, 4 bytes each
        x.sum()  # touch every page once, outside the timing
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        nbytes = x.numel() * x.element_size()
        del x
        method = "torch.sum(float32)" + (", huge pages" if arena is not None else "")
        return {"bandwidth_bytes_per_s": nbytes / best, "buffer_bytes": nbytes, "repeats": repeats,
                "best_seconds": best, "threads": torch.get_num_threads(), "method": method}
    finally:
        torch.set_num_threads(old)


def floor(bandwidth: dict, weight_bytes_per_token: int, none_tokens_per_second: float | None) -> dict:
    """The floor in tokens/s and how close ``none`` comes to it."""
    tps = bandwidth["bandwidth_bytes_per_s"] / weight_bytes_per_token
    return {
        **bandwidth,
        "bandwidth_gb_per_s": bandwidth["bandwidth_bytes_per_s"] / 1e9,
        "weight_bytes_per_token": weight_bytes_per_token,
        "floor_tokens_per_second": tps,
        "none_tokens_per_second": none_tokens_per_second,
        "fraction_of_floor": none_tokens_per_second / tps if none_tokens_per_second else None,
    }
