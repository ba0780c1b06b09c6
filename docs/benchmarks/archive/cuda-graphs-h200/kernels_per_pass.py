"""What a graphed decoding pass spends its time on: the CUDA kernels of one pass of a random model
of Qwen2.5-Coder-1.5B's shape (bfloat16, one row, 256 tokens of context), counted and timed by
torch.profiler, and the pass's wall time replayed as a graph.

    python kernels_per_pass.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from decode_step import config
from quickdraft.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.models.decoder.graphs import static_pass
from quickdraft.models.tiny import _shape

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU for a dry run of this script


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def main():
    c = config("1.5b")
    g = torch.Generator(device=DEV).manual_seed(0)
    weights = {}
    for name in c.weight_names():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(c.hidden_size, dtype=torch.bfloat16, device=DEV)
        else:
            weights[name] = (torch.randn(_shape(c, name), generator=g, device=DEV) * 0.02).to(torch.bfloat16)
    model = Decoder(c, weights)
    kv = KVCache(c, 1, 512, torch.bfloat16, DEV)
    meta = AttentionMetadata.chain([0], [256], [1])
    tokens, positions = torch.tensor([7], device=DEV), meta.positions(DEV)
    for _ in range(3):
        model.forward(tokens, positions, kv, meta)
    times = []
    for _ in range(50):
        sync()
        t = time.perf_counter()
        model.forward(tokens, positions, kv, meta)
        sync()
        times.append(time.perf_counter() - t)
    print(f"graphed pass: {1000 * statistics.median(times):.3f} ms (median of 50)")
    model.graphs = None  # the same pass eagerly, under the profiler
    with torch.inference_mode():
        slots = torch.tensor([0], device=DEV)
        static_pass(model, kv, tokens, positions, slots, 1, 256, c.num_layers)
        sync()
        with profile(activities=[ProfilerActivity.CUDA if DEV == "cuda" else ProfilerActivity.CPU]) as prof:
            static_pass(model, kv, tokens, positions, slots, 1, 256, c.num_layers)
            sync()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA or DEV == "cpu"]
    total = sum(e.device_time for e in events)
    print(f"kernels a pass: {len(events)} ({len(events) / c.num_layers:.1f} a layer), "
          f"GPU time {total / 1000:.3f} ms, mean {total / max(len(events), 1):.2f} us a kernel")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
