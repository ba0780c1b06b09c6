"""1-row streamed time of four of the 1.5B's matrices per prefetch variant, interleaved (12 rounds, medians).

Run over a copy of quickdraft/models/kernels/blocks.cpp (with tiles.h and entry.h) built on its own
as /tmp/exp/build_pf/pf.so by torch.utils.cpp_extension.load, in which PREFETCH and PREFETCH_L2 are
globals and an added set_prefetch(l1_bytes, l2_bytes, l2_at_one_row) sets them, with a
PYBIND11_MODULE exporting linear_blocks and set_prefetch. Used for the README's "On an Intel Xeon
with AMX" (the floor).
"""
import sys, time, statistics, torch
sys.path.insert(0, "/tmp/exp/build_pf")
import pf
from quickdraft.models import registry
from quickdraft.models.gguf import open_gguf, _torch_shape
from quickdraft.models.ggml import BlockWeight
from quickdraft.bench.matrix import _copies
r = open_gguf(registry.model_path("qwen2.5-coder-1.5b-instruct"))
names = ["blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight"]
variants = [(4096, 16384, False), (4096, 16384, True), (8192, 16384, False), (2048, 16384, False), (8192, 32768, True), (4096, 65536, True)]
mats = {}
for n in names:
    t = next(t for t in r.tensors if t.name == n)
    w = BlockWeight.from_gguf(t.tensor_type.name, t.data, tuple(_torch_shape(t)))
    mats[n] = (w, _copies(w, w.nbytes), torch.randn(1, w.in_features, dtype=torch.bfloat16))
res = {(v, n): [] for v in variants for n in names}
with torch.inference_mode():
    for rnd in range(12):
        for v in variants:
            pf.set_prefetch(*v)
            for n, (w, ws, x) in mats.items():
                t0 = time.perf_counter()
                for c in ws: pf.linear_blocks(x, c.data, w.format.kind, w.in_features, None)
                if rnd: res[(v, n)].append((time.perf_counter() - t0) / len(ws))
for v in variants:
    print(v, "  ".join(f"{n.split('.')[2]}:{statistics.median(res[(v,n)])*1e6:.0f}us({mats[n][0].nbytes/statistics.median(res[(v,n)])/2**30:.1f}GiB/s)" for n in names))
