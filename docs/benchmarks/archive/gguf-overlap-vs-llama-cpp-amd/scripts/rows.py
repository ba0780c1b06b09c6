"""Median ms of one pass of 1, 3, 5 and 8 rows after 200 tokens of context, per model (comma-separated
names; stored GGUF blocks). Run alternately on two checkouts (PYTHONPATH=<old checkout> for the old).
    python rows.py qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct
"""
import sys, time, statistics, torch
from quickdraft.models.loader import load_model
from quickdraft.models.decoder import Decoder, AttentionMetadata
from quickdraft.kv_cache import KVCache
out = []
for name in sys.argv[1].split(","):
    m = load_model(name, dtype=torch.bfloat16)
    d = Decoder(m.config, m.weights)
    kv = KVCache(m.config, 1, 1024, d.dtype, d.device)
    ctx = 200
    with torch.inference_mode():
        meta = AttentionMetadata.chain([0], [0], [ctx])
        d.forward(torch.zeros(ctx, dtype=torch.long), meta.positions("cpu"), kv, meta)
        def one(rows):
            meta = AttentionMetadata.chain([0], [ctx], [rows]); t = torch.zeros(rows, dtype=torch.long)
            t0 = time.perf_counter(); d.logits(d.forward(t, meta.positions("cpu"), kv, meta)[-1:]).argmax(); return time.perf_counter() - t0
        rows = [1, 3, 5, 8]
        ts = {r: [] for r in rows}
        for _ in range(3): [one(r) for r in rows]
        for _ in range(25):
            for r in rows: ts[r].append(one(r))
        out.append(name.split("-")[2] + " " + " ".join(f"{r}:{statistics.median(ts[r])*1e3:.1f}" for r in rows))
print(" | ".join(out))
