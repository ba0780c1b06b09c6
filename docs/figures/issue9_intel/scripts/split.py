"""Where a one-row decoding step of the 1.5B goes (stored blocks): the whole pass (forward + the
head's logits) against its parts timed alone, each the median of 30 after a warm-up:
the matrix calls of every layer in a row (one row, in the pass's order, so they stream from
memory as in decoding), the output head, and the rest by difference.
    python docs/figures/issue9_intel/scripts/split.py
"""
import statistics, time, torch
from quickdraft.models.loader import load_model
from quickdraft.models.decoder import Decoder, AttentionMetadata, linear
from quickdraft.kv_cache import KVCache

def median_ms(fn, n=30):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3

m = load_model("qwen2.5-coder-1.5b-instruct", dtype=torch.bfloat16)
d = Decoder(m.config, m.weights)
kv = KVCache(m.config, 1, 1024, d.dtype, d.device)
ctx = 200
with torch.inference_mode():
    meta = AttentionMetadata.chain([0], [0], [ctx])
    d.forward(torch.zeros(ctx, dtype=torch.long), meta.positions("cpu"), kv, meta)
    def step():
        meta = AttentionMetadata.chain([0], [ctx], [1])
        d.logits(d.forward(torch.zeros(1, dtype=torch.long), meta.positions("cpu"), kv, meta)[-1:]).argmax()
    mats = [(n, w) for n, w in d.w.items() if n.endswith("proj.weight")]
    x = {w.in_features: torch.randn(1, w.in_features, dtype=torch.bfloat16) for _, w in mats}
    def matrices():
        for _, w in mats:
            linear(x[w.in_features], w)
    h = torch.randn(1, m.config.hidden_size, dtype=torch.bfloat16)
    head = lambda: d.logits(h)
    res = {"step": [], "matrices": [], "head": []}
    for _ in range(3):  # interleaved rounds
        res["step"].append(median_ms(step, 10)); res["matrices"].append(median_ms(matrices, 10)); res["head"].append(median_ms(head, 10))
    r = {k: statistics.median(v) for k, v in res.items()}
    mb = sum(w.nbytes for _, w in mats) / 2**20
    hb = d.lm_head.nbytes / 2**20
    print(f"one-row step {r['step']:.1f} ms; layers' matrices alone {r['matrices']:.1f} ms ({mb:.0f} MiB, "
          f"{mb / 1024 / r['matrices'] * 1e3:.1f} GB/s); head alone {r['head']:.1f} ms ({hb:.0f} MiB, "
          f"{hb / 1024 / r['head'] * 1e3:.1f} GB/s); the rest {r['step'] - r['matrices'] - r['head']:.1f} ms")
