"""The floor: the fastest plain decoding this machine's memory allows.

Decoding one token at batch 1 reads every weight of the model once (the embedding only by one
row), and on a CPU that read, not the arithmetic, is what takes the time. So

    floor tokens/s = memory read bandwidth / weight bytes read per token

is an upper bound on plain decoding (KV-cache and activation reads, a few MB, are left out), and
``none``'s tokens/s over it says how much of the machine the decoder uses. Speculative methods
can pass it: one target pass reads the weights once and emits several tokens.

The bandwidth is measured the way the decoder reads (quickdraft/evaluation/measure.py's
measure_bandwidth), and measured again beside every ``none`` run: on a machine shared with other
tenants it moves from minute to minute (33 to 62 GB/s within one minute on a 2-core AMD EPYC Zen 4
VM, 2026-12-07), so one probe at the start of a run could put ``none`` at 119% of a floor it
never saw. Each ``none`` run is held to the floor of its own moment, and the fraction reported is
the median of those.
"""

from __future__ import annotations

import statistics

# A probe beside each plain run: 256 MiB, far past any last-level cache, best of 3 reads
# (about 30 ms at 35 GB/s).
PROBE_MIB, PROBE_REPEATS = 256, 3


def floor(samples: list[tuple[dict, float | None]], weight_bytes_per_token: int) -> dict:
    """The floor in tokens/s and how close ``none`` came to it: ``samples`` pairs the bandwidth
    probe taken beside each ``none`` run (measure_bandwidth's dict) with that run's tokens/s."""
    rates = [bw["bandwidth_bytes_per_s"] for bw, _ in samples]
    bandwidth = statistics.median(rates)
    fractions = [tps / (bw["bandwidth_bytes_per_s"] / weight_bytes_per_token) for bw, tps in samples if tps]
    tokens = [tps for _, tps in samples if tps]
    return {
        **{k: v for k, v in samples[0][0].items() if k not in ("bandwidth_bytes_per_s", "best_seconds")},
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_gb_per_s": bandwidth / 1e9,
        "bandwidth_gb_per_s_range": [min(rates) / 1e9, max(rates) / 1e9],
        "probes": len(samples),
        "weight_bytes_per_token": weight_bytes_per_token,
        "floor_tokens_per_second": bandwidth / weight_bytes_per_token,
        "none_tokens_per_second": statistics.median(tokens) if tokens else None,
        "fraction_of_floor": statistics.median(fractions) if fractions else None,
    }
