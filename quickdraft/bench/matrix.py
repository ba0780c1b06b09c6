"""Per-matrix cost by rows: how a verification pass of M rows costs against one row, for one of a
GGUF file's matrices on its stored blocks (models/ggml.py) and dequantized to bfloat16 (the dense
kernel), measured side by side (interleaved, warmed up, medians).

    python -m quickdraft.bench.matrix --model qwen2.5-coder-1.5b-instruct --tensor blk.0.ffn_gate.weight
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from quickdraft.models import registry
from quickdraft.models.decoder import linear, nbytes
from quickdraft.models.ggml import BlockWeight
from quickdraft.models.gguf import _torch_shape, open_gguf


def _time(fn, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def measure(model: str, tensor: str, rows: list[int], rounds: int = 15, repeats: int = 5) -> list[dict]:
    """For each row count: median seconds of the block kernel and of the bfloat16 kernel."""
    path = registry.model_path(model) if registry.is_builtin(model) else model
    t = next(t for t in open_gguf(path).tensors if t.name == tensor)
    blocks = BlockWeight.from_gguf(t.tensor_type.name, t.data, _torch_shape(t))
    dense = blocks.dequantize(torch.bfloat16)
    out = []
    for m in rows:
        x = torch.randn(m, blocks.shape[1]).to(torch.bfloat16)
        cases = {"blocks": lambda: blocks.linear(x), "bf16": lambda: linear(x, dense)}
        for fn in cases.values():
            _time(fn, 3)  # warm-up
        samples = {k: [] for k in cases}
        for _ in range(rounds):  # interleaved: A B A B
            for k, fn in cases.items():
                samples[k].append(_time(fn, repeats))
        med = {k: statistics.median(v) for k, v in samples.items()}
        out.append({"rows": m, "format": t.tensor_type.name, "shape": list(blocks.shape),
                    "blocks_ms": med["blocks"] * 1e3, "bf16_ms": med["bf16"] * 1e3,
                    "blocks_bytes": blocks.nbytes, "bf16_bytes": nbytes(dense)})
    base = {k: out[0][k] for k in ("blocks_ms", "bf16_ms")}
    for r in out:
        r["blocks_vs_1_row"] = r["blocks_ms"] / base["blocks_ms"]
        r["bf16_vs_1_row"] = r["bf16_ms"] / base["bf16_ms"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--tensor", default="blk.0.ffn_gate.weight")
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads; default: torch's")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.model, args.tensor, [int(r) for r in args.rows.split(",")])
    if args.json:
        print(json.dumps(rows))
        return 0
    r0 = rows[0]
    print(f"{args.tensor} {r0['format']} {r0['shape']}: {r0['blocks_bytes'] / 2**20:.1f} MiB as blocks, "
          f"{r0['bf16_bytes'] / 2**20:.1f} MiB in bfloat16; torch threads {torch.get_num_threads()}")
    print(f"{'rows':>5} {'blocks ms':>10} {'x 1 row':>8} {'bf16 ms':>9} {'x 1 row':>8}")
    for r in rows:
        print(f"{r['rows']:>5} {r['blocks_ms']:>10.2f} {r['blocks_vs_1_row']:>8.2f} {r['bf16_ms']:>9.2f} {r['bf16_vs_1_row']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
