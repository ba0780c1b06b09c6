"""attend_chain alone on the 1.5B's shapes (12 heads, 2 KV heads, head_dim 128, bfloat16 keys), median ms a
call, for decoding rows (ctx 200 or 1000, 1 to 16 rows) and prompt passes (810 and 2000 rows).
    python docs/benchmarks/archive/gguf-vs-llama-cpp-intel-amx/scripts/attention.py
"""
import statistics, time, torch, os
from quickdraft.models.kernels import chain_attention
f = chain_attention()
H, Hkv, d = 12, 2, 128
for ctx, m in [(200, 1), (200, 5), (200, 16), (1000, 1), (1000, 16), (0, 810), (0, 2000)]:
    L = ctx + m
    keys = torch.randn(Hkv, L, d).to(torch.bfloat16); values = torch.randn(Hkv, L, d).to(torch.bfloat16)
    q = torch.randn(m, H, d)
    n = 200 if m < 100 else 5
    for _ in range(3): f(q, keys, values, ctx, 0.088)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(q, keys, values, ctx, 0.088); ts.append(time.perf_counter() - t0)
    print(os.environ.get("CONVERT_ROWS"), ctx, m, f"{statistics.median(ts)*1e3:.3f} ms")
