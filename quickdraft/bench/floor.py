"""The floor: the fastest plain decoding this machine's memory allows.

Decoding one token at batch 1 reads every weight of the model once (the embedding only by one
row), and on a CPU that read, not the arithmetic, is what takes the time. So

    floor tokens/s = memory read bandwidth / weight bytes read per token

is an upper bound on plain decoding (KV-cache and activation reads, a few MB, are left out), and
``none``'s tokens/s over it says how much of the machine the decoder uses. Speculative methods
can pass it: one target pass reads the weights once and emits several tokens.

The bandwidth is measured the way the decoder reads (quickdraft/evaluation/measure.py's measure_bandwidth).
"""

from __future__ import annotations

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
