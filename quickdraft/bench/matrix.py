"""Per-matrix cost by rows: how a verification pass of M rows costs against one row, for one of a
GGUF file's matrices on its stored blocks (models/ggml.py) and dequantized to bfloat16 (the dense
kernel), measured side by side (interleaved, warmed up, medians).

A decoding step reads each matrix from memory, not from cache, so each timed call goes to the
next of enough copies of the matrix (in huge pages, as the loader places weights) to fill
256 MB: a matrix small enough for the L3 cache would otherwise look several times faster.
Beside it, the blocks' cost with the weights hot in cache (the first tiles of the matrix, about
512 KiB, called again and again; the fastest of 200 calls, which a shared machine disturbs
least): what the arithmetic and the loads cost, in ns per 512 weights of one weight row.
And the arithmetic's floor: every row of a pass costs one 512-bit vpdpbusd per 64 products, in
any layout, so rows x weights / 64 of them at this machine's measured rate (``vnni_rate``, one
core, times the threads) is a pass's least time once the weights are read (on a Zen 4 core, one
a cycle: 512-bit operations run as two 256-bit halves). Where the block kernels run on AMX (an
Intel Xeon with AMX-INT8), the blocks are timed a second time with AMX off, in the same rounds.

    python -m quickdraft.bench.matrix --model qwen2.5-coder-1.5b-instruct --tensor blk.0.ffn_gate.weight \
        --plot docs/benchmarks/archive/gguf-cost-by-rows-amd/gguf_rows.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm import tqdm

from quickdraft.models import registry
from quickdraft.models.decoder import linear, nbytes
from quickdraft.models.ggml import LANES, BlockWeight
from quickdraft.kernels import block_linear
from quickdraft.models.gguf import _torch_shape, open_gguf
from quickdraft.models.memory import into_huge_pages


STREAM_BYTES = 256 << 20


def _copies(w, nbytes: int) -> list:
    n = max(2, STREAM_BYTES // nbytes)
    if isinstance(w, BlockWeight):
        made = {str(i): BlockWeight(w.ggml_type, w.data.clone(), w.in_features, w.out_features) for i in range(n)}
    else:
        made = {str(i): w.clone() for i in range(n)}
    return list(into_huge_pages(made).values())


def _time(fn, weights: list) -> float:
    """Seconds a call, each call on the next copy."""
    t0 = time.perf_counter()
    for w in weights:
        fn(w)
    return (time.perf_counter() - t0) / len(weights)


def measure(model: str, tensor: str, rows: list[int], rounds: int = 9) -> list[dict]:
    """For each row count: median seconds of the block kernel and of the bfloat16 kernel."""
    path = registry.model_path(model) if registry.is_builtin(model) else model
    t = next(t for t in open_gguf(path).tensors if t.name == tensor)
    blocks = BlockWeight.from_gguf(t.tensor_type.name, t.data, _torch_shape(t))
    dense = blocks.dequantize(torch.bfloat16)
    weights = {"blocks": _copies(blocks, blocks.nbytes), "bf16": _copies(dense, nbytes(dense))}
    weights["blocks_vnni"] = weights["blocks"]
    tiles = max(1, min(blocks.data.shape[0], (512 << 10) // blocks.data.shape[1]))
    hot = BlockWeight(blocks.ggml_type, blocks.data[:tiles].clone(), blocks.in_features, tiles * LANES)
    module = block_linear()
    rate = module.vnni_rate(2000) * torch.get_num_threads() if module is not None else None  # a second, all threads
    amx = module is not None and module.amx_active()
    out = []
    for m in tqdm(rows, desc=f"{tensor} by rows", leave=False):
        x = torch.randn(m, blocks.shape[1]).to(torch.bfloat16)
        cases = {"blocks": lambda w: w.linear(x), "bf16": lambda w: linear(x, w)}
        if amx:  # the same blocks with AMX switched off, in the same rounds
            cases["blocks_vnni"] = lambda w: _without_amx(module, lambda: w.linear(x))
        for k, fn in cases.items():
            _time(fn, weights[k])  # warm-up
        samples = {k: [] for k in cases}
        for _ in range(rounds):  # interleaved: A B A B
            for k, fn in cases.items():
                samples[k].append(_time(fn, weights[k]))
        med = {k: statistics.median(v) for k, v in samples.items()}
        hot_s = min(_time(lambda w: w.linear(x), [hot]) for _ in range(200))
        out.append({"rows": m, "format": t.tensor_type.name, "shape": list(blocks.shape),
                    "blocks_ms": med["blocks"] * 1e3, "bf16_ms": med["bf16"] * 1e3,
                    "blocks_bytes": blocks.nbytes, "bf16_bytes": nbytes(dense),
                    "hot_ns_per_512": hot_s * 1e9 / (hot.out_features * hot.in_features / 512),
                    "vnni_floor_ms": m * blocks.out_features * blocks.in_features / 64 / rate * 1e3 if rate else None,
                    "amx": amx, "blocks_vnni_ms": med["blocks_vnni"] * 1e3 if amx else None})
    base = {k: out[0][k] for k in ("blocks_ms", "bf16_ms")}
    for r in out:
        r["blocks_vs_1_row"] = r["blocks_ms"] / base["blocks_ms"]
        r["bf16_vs_1_row"] = r["bf16_ms"] / base["bf16_ms"]
        if amx:
            r["blocks_vnni_vs_1_row"] = r["blocks_vnni_ms"] / out[0]["blocks_vnni_ms"]
    return out


def _without_amx(module, fn):
    was = module.use_amx(False)
    try:
        return fn()
    finally:
        module.use_amx(was)


def plot(rows: list[dict], tensor: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ms = [r["rows"] for r in rows]
    r0 = rows[0]
    ax.plot(ms, [r["blocks_ms"] for r in rows], "o-", label=f"stored {r0['format']} blocks ({r0['blocks_bytes'] / 2**20:.1f} MiB)")
    ax.plot(ms, [r["bf16_ms"] for r in rows], "s-", label=f"bfloat16 ({r0['bf16_bytes'] / 2**20:.1f} MiB)")
    if r0["amx"]:
        ax.plot(ms, [r["blocks_vnni_ms"] for r in rows], "d-", label="the same blocks, AMX off (VNNI only)")
    if r0["vnni_floor_ms"] is not None:
        ax.plot(ms, [r["vnni_floor_ms"] for r in rows], "^:", color="black", linewidth=0.8,
                label="the blocks' vpdpbusd alone, at this machine's rate")
    for factor, style in ((1.5, ":"), (2.5, "--")):
        ax.axhline(r0["blocks_ms"] * factor, color="grey", linestyle=style, linewidth=0.8,
                   label=f"{factor}x the blocks' 1 row")
    ax.set_xlabel("rows in the pass")
    ax.set_ylabel("ms a call (median, from memory)")
    ax.set_title(f"{tensor} {r0['shape'][0]}x{r0['shape'][1]}: cost by rows")
    ax.set_xticks(ms)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--tensor", default="blk.0.ffn_gate.weight")
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads; default: torch's")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, help="write a plot of ms against rows (PNG)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.model, args.tensor, [int(r) for r in args.rows.split(",")])
    if args.plot:
        plot(rows, args.tensor, args.plot)
    if args.json:
        print(json.dumps(rows))
        return 0
    r0 = rows[0]
    print(f"{args.tensor} {r0['format']} {r0['shape']}: {r0['blocks_bytes'] / 2**20:.1f} MiB as blocks, "
          f"{r0['bf16_bytes'] / 2**20:.1f} MiB in bfloat16; torch threads {torch.get_num_threads()}")
    print(f"{'rows':>5} {'blocks ms':>10} {'x 1 row':>8} {'bf16 ms':>9} {'x 1 row':>8} {'hot ns/512':>11} "
          f"{'vnni floor ms':>14} {'x 1 row':>8}")
    module = block_linear()
    if r0["amx"]:
        print(f"blocks: passes of {module.amx_min_rows()}+ rows on AMX; beside them the same blocks with AMX off")
    for r in rows:
        floor = r["vnni_floor_ms"]
        floor_cols = f"{floor:>14.3f} {floor / r0['blocks_ms']:>8.2f}" if floor is not None else f"{'-':>14} {'-':>8}"
        vnni = f"  AMX off: {r['blocks_vnni_ms']:.2f} ms, {r['blocks_vnni_vs_1_row']:.2f}x" if r["amx"] else ""
        print(f"{r['rows']:>5} {r['blocks_ms']:>10.2f} {r['blocks_vs_1_row']:>8.2f} {r['bf16_ms']:>9.2f} "
              f"{r['bf16_vs_1_row']:>8.2f} {r['hot_ns_per_512']:>11.1f} {floor_cols}{vnni}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
