"""sampling.logits_to_probs on real draft logits: the 0.5B's last 64 rows over the first 256
tokens of two of this repository's files (code and prose), one row and five rows a call, under a
temperature alone, top-p, top-k and min-p; medians in ms, the CPU kernels' path or torch's.

    python shape_rows.py kernels|torch
"""
import statistics
import sys
import time
from pathlib import Path

import torch

from quickdraft import sampling
from quickdraft.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.models.loader import load_model
from quickdraft.sampling import logits_to_probs

ROOT = Path(__file__).resolve().parents[4]
CASES = {"temperature 0.7": (0.7, 0, 1.0, 0.0), "top_p 0.9": (0.7, 0, 0.9, 0.0), "top_p 0.95, t 1": (1.0, 0, 0.95, 0.0),
         "top_k 50": (0.7, 50, 1.0, 0.0), "top_k 50, top_p 0.9": (0.7, 50, 0.9, 0.0), "min_p 0.05": (0.7, 0, 1.0, 0.05)}


def real_logits() -> torch.Tensor:
    """[128, 151936] float32: the 0.5B's logits over the last 64 of 256 tokens of two files."""
    model = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16)
    decoder = Decoder(model.config, model.weights)
    rows = []
    for name in ("quickdraft/stats.py", "README.md"):
        ids = model.tokenizer.encode((ROOT / name).read_text())[:256]
        kv = KVCache(decoder.config, 1, len(ids), decoder.dtype, decoder.device)
        meta = AttentionMetadata.chain([0], [0], [len(ids)])
        rows.append(decoder.logits(decoder.forward(torch.tensor(ids), meta.positions("cpu"), kv, meta)[-64:]))
    return torch.cat(rows)


if __name__ == "__main__":
    logits = real_logits()
    if sys.argv[1] == "torch":
        sampling.row_kernels = lambda x: None
    for n in (1, 5):
        for name, (t, k, p, m) in CASES.items():
            params = (torch.full((n,), t), torch.full((n,), k, dtype=torch.long), torch.full((n,), p),
                      torch.full((n,), m))
            seconds = []
            for r in range(0, 125, n):
                start = time.perf_counter()
                logits_to_probs(logits[r:r + n].contiguous(), *params)
                seconds.append(time.perf_counter() - start)
            print(f"{sys.argv[1]:7s} rows {n}  {name:21s} {statistics.median(seconds[2:]) * 1e3:7.3f} ms", flush=True)
