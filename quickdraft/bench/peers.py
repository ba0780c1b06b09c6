"""The engines people would use instead, on the same weights and the same prompt token ids.

- ``transformers``: the target's GGUF dequantized by Hugging Face transformers
  (``from_pretrained(dir, gguf_file=...)``, in the bench's dtype): plain greedy ``generate``,
  assisted generation with the same draft (``assistant_model=``, K draft tokens a step, the
  constant schedule and no confidence cut-off, like quickdraft's fixed K) and prompt lookup
  (``prompt_lookup_num_tokens=K``, ``max_matching_ngram_size`` = the n-gram size).
- ``llama.cpp`` through ``llama-cpp-python``: the GGUF as it is (quantized: it reads fewer bytes
  per token than a bfloat16 engine), plain greedy decoding and its prompt lookup draft
  (``LlamaPromptLookupDecoding``).

Each is an optional extra (``pip install quickdraft[peers]``); a peer that is not installed, or
cannot read the model, is skipped with a note. Peers run greedy only, after quickdraft's runs (the
quickdraft engines are freed first), each request once per peer method after a warm-up. Timing
follows quickdraft's: tokens/s counts the tokens after the first over the time from the first
token to the last; the first token's time comes from a streamer (transformers) or the first
token the generator yields (llama.cpp).
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from quickdraft.bench import stats
from quickdraft.bench.summary import ALL, groups

PEERS = ("transformers", "llama_cpp")
COUNTERPART = {"plain": "none", "assisted": "draft_model", "prompt_lookup": "ngram"}


@dataclass
class PeerMethod:
    peer: str  # "transformers" | "llama_cpp"
    method: str  # "plain" | "assisted" | "prompt_lookup"
    settings: dict
    generate: Callable[[list[int]], dict]  # prompt ids -> token_ids, timing

    @property
    def name(self) -> str:
        k = self.settings.get("k")
        return f"{self.peer} {self.method}" + (f" K={k}" if k else "")


def _timing(ids_out: list[int], start: float, first: float | None, end: float) -> dict:
    n = len(ids_out)
    first = first if first is not None else end
    seconds = end - first
    return {"token_ids": ids_out, "num_tokens": n, "ttft_s": first - start, "seconds": seconds,
            "total_seconds": end - start, "tokens_per_second": (n - 1) / seconds if n > 1 and seconds > 0 else 0.0}


def _cut(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


# -- transformers ---------------------------------------------------------------------------------

def _hf_load(source: str, dtype):
    import transformers
    from transformers import AutoModelForCausalLM

    path = Path(source)
    kw = {"dtype": dtype} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dtype}
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    return model.eval()


def transformers_methods(target: str, draft: str | None, dtype, k: int, lookup_max: int, max_tokens: int,
                         eos: set[int], ignore_eos: bool) -> list[PeerMethod]:
    """Plain, assisted (when there is a draft) and prompt lookup generation; target and draft are
    a .gguf file or a Hugging Face directory."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """Times the first generated token: generate puts the prompt first, then new tokens."""

        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self):
            pass

    model = _hf_load(target, dtype)
    eos_list = sorted(eos)
    base = {"max_new_tokens": max_tokens, "do_sample": False, "pad_token_id": eos_list[0] if eos_list else 0}
    base.update({"min_new_tokens": max_tokens} if ignore_eos else {"eos_token_id": eos_list})

    def runner(extra: dict) -> Callable[[list[int]], dict]:
        def generate(ids: list[int]) -> dict:
            x = torch.tensor([ids], dtype=torch.long)
            clock = Clock()
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), streamer=clock, **base, **extra)
            end = time.perf_counter()
            return _timing(_cut(out[0, len(ids):].tolist(), set() if ignore_eos else eos), start, clock.first, end)

        return generate

    methods = [PeerMethod("transformers", "plain", {}, runner({}))]
    if draft is not None:
        assistant = _hf_load(draft, dtype)
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        methods.append(PeerMethod("transformers", "assisted", {"k": k, "schedule": "constant",
                                                               "assistant_confidence_threshold": 0.0},
                                  runner({"assistant_model": assistant})))
    methods.append(PeerMethod("transformers", "prompt_lookup", {"k": k, "max_matching_ngram_size": lookup_max},
                              runner({"prompt_lookup_num_tokens": k, "max_matching_ngram_size": lookup_max})))
    return methods


# -- llama.cpp ----------------------------------------------------------------------------------

def llama_cpp_methods(target: str, k: int, lookup_max: int, max_tokens: int, eos: set[int], threads: int,
                      n_ctx: int) -> list[PeerMethod]:
    """Plain and prompt lookup decoding on the target's .gguf file."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if Path(target).is_dir():
        raise ValueError("llama.cpp reads GGUF files only, and the target is a Hugging Face directory")

    def load(**kw):
        return Llama(model_path=target, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                     verbose=False, **kw)

    def runner(llm) -> Callable[[list[int]], dict]:
        def generate(ids: list[int]) -> dict:
            llm.reset()  # no reuse of an earlier request's prefix: every request pays its prompt
            out, first = [], None
            start = time.perf_counter()
            for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                if first is None:
                    first = time.perf_counter()
                if token in eos:
                    break
                out.append(int(token))
                if len(out) >= max_tokens:
                    break
            return _timing(out, start, first, time.perf_counter())

        return generate

    lookup = LlamaPromptLookupDecoding(num_pred_tokens=k, max_ngram_size=lookup_max)
    return [PeerMethod("llama_cpp", "plain", {}, runner(load())),
            PeerMethod("llama_cpp", "prompt_lookup", {"k": k, "max_ngram_size": lookup_max},
                       runner(load(draft_model=lookup)))]


# -- the run ------------------------------------------------------------------------------------

def _installed(peer: str) -> bool:
    module = {"transformers": "transformers", "llama_cpp": "llama_cpp"}[peer]
    return importlib.util.find_spec(module) is not None


def build(config, target: str, draft: str | None, eos: set[int], notes: list[str]) -> list[PeerMethod]:
    import torch

    from quickdraft.config import EngineConfig

    dtype = EngineConfig(model=config.model, dtype=config.dtype).torch_dtype
    lookup_max = next((v.lookup_max for v in config.variants if v.method == "ngram"), 4)
    eos = set() if config.ignore_eos else eos
    methods: list[PeerMethod] = []
    for peer in config.peers:
        if not _installed(peer):
            extra = "transformers accelerate" if peer == "transformers" else "llama-cpp-python"
            notes.append(f"peer {peer} skipped: not installed (pip install 'quickdraft[peers]', or {extra})")
            continue
        try:
            if peer == "transformers":
                methods += transformers_methods(target, draft, dtype, config.peer_k, lookup_max, config.max_tokens,
                                                eos, config.ignore_eos)
            else:
                methods += llama_cpp_methods(target, config.peer_k, lookup_max, config.max_tokens, eos,
                                             torch.get_num_threads(), config.max_model_len)
        except Exception as e:  # a peer's own failure (format, version) must not lose quickdraft's figures
            notes.append(f"peer {peer} skipped: it could not load {target}: {type(e).__name__}: {e}")
    return methods


def run_peers(config, target: str, draft: str | None, eos: set[int], requests, qd_runs: list[dict],
              notes: list[str], progress: bool) -> dict:
    """Every peer method on every request (greedy), and their summary beside quickdraft's runs."""
    from tqdm import tqdm

    if not config.greedy:
        notes.append("peers skipped: they are compared at temperature 0 only")
        return {"methods": [], "runs": [], "summary": []}
    methods = build(config, target, draft, eos, notes)
    runs = []
    if methods:
        for m in methods:  # warm-up, as for quickdraft's engines
            m.generate(requests[0].prompt_token_ids[:64])
        bar = tqdm(total=len(methods) * len(requests), desc="peers", unit="run", disable=not progress)
        for i, req in enumerate(requests):
            rot = i % len(methods)
            for m in methods[rot:] + methods[:rot]:
                bar.set_postfix_str(f"{req.id} {m.name}"[:60], refresh=False)
                runs.append({"request": req.id, "peer": m.peer, "method": m.method, "name": m.name,
                             **m.generate(req.prompt_token_ids)})
                bar.update(1)
        bar.close()
    info = [{"name": m.name, "peer": m.peer, "method": m.method, "settings": m.settings,
             "counterpart_method": COUNTERPART[m.method]} for m in methods]
    return {"methods": info, "runs": runs,
            "summary": summarize(info, runs, [r.to_dict() for r in requests], qd_runs, config.peer_k,
                                 {v.name: {"method": v.method, "k": v.k} for v in config.variants})}


def counterpart(method: str, k: int, variant_methods: dict[str, dict]) -> str | None:
    """The quickdraft variant a peer method is set beside: same method, K = the peers' K (or the
    nearest K measured)."""
    want = COUNTERPART[method]
    names = [n for n, v in variant_methods.items() if v["method"] == want]
    if not names:
        return None
    return min(names, key=lambda n: abs(variant_methods[n]["k"] - k))


def summarize(methods: list[dict], runs: list[dict], requests: list[dict], qd_runs: list[dict], k: int,
              variant_methods: dict[str, dict]) -> list[dict]:
    """Per peer method x group: tokens/s, speedup over the peer's own plain decoding, quickdraft's
    counterpart beside it and the paired ratio quickdraft / peer; greedy agreement with
    quickdraft's ``none``."""
    qd = {(r["variant"], r["request"]): r for r in qd_runs if r.get("repeat", 0) == 0}
    rows = []
    for dataset, category, ids in groups(requests):
        if category != ALL:
            continue
        for m in methods:
            mine = {r["request"]: r for r in runs if r["name"] == m["name"] and r["request"] in ids}
            plain = {r["request"]: r["tokens_per_second"] for r in runs
                     if r["peer"] == m["peer"] and r["method"] == "plain" and r["request"] in ids}
            if not mine:
                continue
            twin = counterpart(m["method"], k, variant_methods)
            theirs = {q: r["tokens_per_second"] for q, r in mine.items()}
            ours = {q: qd[(twin, q)]["tokens_per_second"] for q in mine if (twin, q) in qd}
            none = {q: qd[("none", q)]["token_ids"] for q in mine if ("none", q) in qd}
            same = [mine[q]["token_ids"] == none[q] for q in none]
            rows.append({
                "name": m["name"], "peer": m["peer"], "method": m["method"], "dataset": dataset, "n": len(mine),
                "tokens_per_second_median": stats.median(list(theirs.values())),
                "ttft_median_s": stats.median([r["ttft_s"] for r in mine.values()]),
                "speedup_over_own_plain": stats.speedup(plain, theirs)["median"],
                "quickdraft_variant": twin,
                "quickdraft_tokens_per_second_median": stats.median(list(ours.values())) if ours else None,
                "quickdraft_over_peer": stats.speedup(theirs, ours)["median"] if ours else None,
                "fraction_identical_to_quickdraft_none": sum(same) / len(same) if same else None,
            })
    return rows

