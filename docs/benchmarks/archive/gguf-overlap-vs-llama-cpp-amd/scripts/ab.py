"""Interleaved A/B of kernel variants on a streamed matrix and L3-resident. argv: tensor, variants as mod:l1:l2, rows.

Each variant is a copy of quickdraft/models/kernels/blocks.cpp (with tiles.h) built on its own as
/tmp/exp/build_<mod>/<mod>.so by torch.utils.cpp_extension.load, with the prefetch distances made
runtime globals set by an added set_prefetch(l1_bytes, l2_bytes) (0 = off) and a PYBIND11_MODULE
exporting linear_blocks and set_prefetch. Used for the README's "Memory and arithmetic overlapped":
    python ab.py blk.0.ffn_gate.weight "exp_bc:4096:0,exp_bc:4096:8192,exp_bc:4096:16384,..." 1,3,5,8
"""
import sys, time, statistics, torch, importlib
from quickdraft.models import registry
from quickdraft.models.gguf import open_gguf, _torch_shape
from quickdraft.models.ggml import BlockWeight
from quickdraft.bench.matrix import _copies
model = "qwen2.5-coder-1.5b-instruct"
tensor = sys.argv[1]
variants = []
for v in sys.argv[2].split(","):
    name, a, b = v.split(":")
    sys.path.insert(0, f"/tmp/exp/build_{name}")
    variants.append((v, importlib.import_module(name), int(a), int(b)))
rows = [int(x) for x in sys.argv[3].split(",")]
r = open_gguf(registry.model_path(model))
t = next(t for t in r.tensors if t.name == tensor)
w = BlockWeight.from_gguf(t.tensor_type.name, t.data, tuple(_torch_shape(t)))
ws = _copies(w, w.nbytes); K = w.in_features
xs = {m: torch.randn(m, K, dtype=torch.bfloat16) for m in rows}
print(tensor, w.ggml_type, tuple(w.shape))
res = {(v[0], m, hot): [] for v in variants for m in rows for hot in (0, 1)}
with torch.inference_mode():
    for rnd in range(10):
        for name, mod, a, b in variants:
            mod.set_prefetch(a, b)
            for m in rows:
                t0 = time.perf_counter()
                for c in ws: mod.linear_blocks(xs[m], c.data, w.format.kind, K, None)
                dt = (time.perf_counter() - t0) / len(ws)
                t0 = time.perf_counter()
                for _ in range(len(ws)): mod.linear_blocks(xs[m], ws[0].data, w.format.kind, K, None)
                dh = (time.perf_counter() - t0) / len(ws)
                if rnd: res[(name, m, 0)].append(dt); res[(name, m, 1)].append(dh)
for name, *_ in variants:
    base = statistics.median(res[(name, 1, 0)])
    print(f"{name:22s} stream:", "  ".join(f"{m}:{statistics.median(res[(name,m,0)])*1e3:.3f} ({statistics.median(res[(name,m,0)])/base:.2f}x)" for m in rows))
    print(f"{'':22s} L3    :", "  ".join(f"{m}:{statistics.median(res[(name,m,1)])*1e3:.3f}" for m in rows))
