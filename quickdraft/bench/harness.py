"""The benchmark loop: every method x setting against ``none`` on one target, request by request.

A *variant* is one method with one setting (``ngram K=4 n=1..4``); ``none`` is always one of
them. Each variant keeps one engine for the whole run, as a server would: ``suffix`` drafts from
the answers it gave to the requests before (its global cache), the warm-up's included. A *request* is one generation: a raw prompt, or one turn of a conversation. A later turn is
built from ``none``'s answer to the turn before, so every variant is timed on the same prompt.

Order: the target (and the draft) are loaded once and shared by every variant's engine; each
engine is warmed up; then, request by request, every variant runs back to back, in an order
rotated from one request to the next so that no variant always runs first. Greedy runs are
compared with ``none``'s token for token; at the first divergence the target's top-2 logit margin
is read from a plain forward pass over the common prefix, so that a near-tie (rounding) can be
told from a bug. At temperature > 0 each request is sampled with ``num_seeds`` seeds by every
variant, and each variant's per-position token distribution is compared with ``none``'s.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from quickdraft.bench.floor import PROBE_MIB, PROBE_REPEATS, floor
from quickdraft.config import TREE_METHODS, EngineConfig
from quickdraft.errors import ConfigError
from quickdraft.evaluation import datasets, stats
from quickdraft.evaluation.measure import RssSampler, measure_bandwidth, summarize, top2_margin
from quickdraft.models.config import activation_dtype
from quickdraft.models.decoder import nbytes
from quickdraft.models.loader import LoadedModel, load_model
from quickdraft.proposers.heads.common import head_bytes
from quickdraft.sampling import SamplingParams

MIB = 1 << 20


@dataclass(frozen=True)
class Variant:
    method: str
    k: int = 0  # num_speculative_tokens; 0 for none
    lookup_max: int | None = None  # ngram only
    lookup_min: int | None = None
    draft: str | None = None  # draft_model only: the draft's name or path
    adaptive: bool = True  # K planned per step up to k (engine/plan.py); False: always k
    branches: int = 1  # ngram, suffix: > 1 drafts token trees of at most k nodes
    cross_tokenizer: bool = False  # draft_model: the draft proposes through text (proposers/draft_text.py)
    # any other keys of the speculative config, as (key, value) pairs (--speculative-config's
    # variant: {"quantization": "q4_0"}, {"draft_vocab_size": 32768}, ...)
    options: tuple = ()
    named_draft: bool = False  # draft_model: the name says which draft (set when a run compares several)

    @property
    def name(self) -> str:
        if self.method == "none":
            return "none"
        fixed = "" if self.adaptive else " fixed"
        tree = f" tree B={self.branches}" if self.branches > 1 else ""
        if self.cross_tokenizer:
            tree += f" text {os.path.basename(self.draft or '')}"
        elif self.named_draft:
            tree += f" model={os.path.basename(os.path.normpath(self.draft or ''))}"
        extra = "".join(f" {k}={os.path.basename(str(v)) if k == 'model' else v}" for k, v in self.options)
        if self.method == "ngram":
            return f"ngram K={self.k}{fixed}{tree} n={self.lookup_min}..{self.lookup_max}{extra}"
        return f"{self.method} K={self.k}{fixed}{tree}{extra}"

    def spec(self, draft: LoadedModel | None) -> dict | None:
        if self.method == "none":
            return None
        spec = {"method": self.method, "num_speculative_tokens": self.k, "adaptive": self.adaptive}
        if self.method == "ngram":
            spec.update(prompt_lookup_max=self.lookup_max, prompt_lookup_min=self.lookup_min)
        if self.method == "draft_model":
            spec["model"] = draft
            if self.cross_tokenizer:
                spec["cross_tokenizer"] = True
        if self.branches > 1:
            spec["num_branches"] = self.branches
        return spec | dict(self.options)

    def to_dict(self) -> dict:
        return {"name": self.name, **asdict(self)}


def variants(methods: list[str], ks: list[int], draft: str | None, lookup_max: list[int],
             lookup_min: list[int], adaptive: tuple[bool, ...] = (True,), branches: list[int] = (1,)) -> list[Variant]:
    """Every combination, ``none`` first (added when not asked for: it is the baseline); branch
    counts apply to the methods that draft trees (config.TREE_METHODS)."""
    out = [Variant("none")]
    for m in methods:
        if m == "none":
            continue
        for k in ks:
            for a in adaptive:
                for b in (branches if m in TREE_METHODS else (1,)):
                    if m == "ngram":
                        out += [Variant(m, k, hi, lo, adaptive=a, branches=b)
                                for hi in lookup_max for lo in lookup_min if lo <= hi]
                    else:
                        out.append(Variant(m, k, draft=draft if m == "draft_model" else None, adaptive=a, branches=b))
    return out


@dataclass
class BenchConfig:
    model: str
    variants: list[Variant]
    datasets: list[str]
    limit: int | dict[str, int | None] | None = None  # prompts per data set (a dict: by name); None = all
    categories: list[str] | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    num_seeds: int = 1  # samples per request and variant at temperature > 0
    repeats: int = 1  # times each request is run by each variant (greedy)
    warmup_tokens: int = 8
    ignore_eos: bool = False
    dtype: str = "bfloat16"
    device: str = "cpu"
    quantization: str | None = "auto"  # "gguf": target and drafts on their stored GGUF blocks; see load_model
    max_model_len: int = 2048
    permutations: int = 200  # TV permutation test
    peers: list[str] = field(default_factory=list)
    peer_k: int = 4
    peer_timeout: float = 1800.0  # seconds each peer's child process may run (load, warm-up, every request)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["variants"] = [v.to_dict() for v in self.variants]
        return d


@dataclass
class Request:
    id: str
    dataset: str
    category: str
    prompt_id: str
    turn: int
    prompt_text: str
    prompt_token_ids: list[int]

    def to_dict(self) -> dict:
        return {**asdict(self), "num_prompt_tokens": len(self.prompt_token_ids)}


def timed_generate(llm, ids: list[int], params: SamplingParams) -> dict:
    """One request alone on ``llm``: its tokens, timing, speculative counters and peak RSS."""
    with RssSampler() as rss:
        out = llm.generate([ids], params)[0]
    report = summarize(out, llm.engine.config.speculative)
    s = out.spec
    return {
        "token_ids": out.token_ids, "text": out.text, "num_tokens": len(out.token_ids),
        "finish_reason": out.finish_reason, "tokens_per_second": report["tokens_per_second"],
        "seconds": report["seconds"], "ttft_s": (out.first_token_time or out.arrival_time) - out.arrival_time,
        "total_seconds": (out.finish_time or 0.0) - out.arrival_time,
        "num_target_passes": s.num_target_passes, "num_draft_tokens": s.num_draft_tokens,
        "num_accepted_tokens": s.num_accepted_tokens, "num_emitted_tokens": s.num_emitted_tokens,
        "drafts_per_position": list(s.drafts_per_position), "accepted_per_position": list(s.accepted_per_position),
        "peak_rss_mib": rss.peak / MIB,
    }


class Harness:
    def __init__(self, config: BenchConfig, progress: bool = True):
        self.config, self.progress = config, progress
        self.notes: list[str] = []

    # -- set-up -------------------------------------------------------------------------------
    def prompts(self) -> list[datasets.Prompt]:
        rows = []
        for name in self.config.datasets:
            limit = self.config.limit.get(name) if isinstance(self.config.limit, dict) else self.config.limit
            rows += datasets.load(name, limit, self.config.categories)
        if not rows:
            raise ConfigError("no prompts: check --datasets, --categories and --limit", "datasets")
        return rows

    def _engines(self, target: LoadedModel, drafts: dict[str, LoadedModel]) -> dict:
        from quickdraft import LLM

        c = self.config
        # The prefix cache stays off: a prompt is run once per variant, seed and repeat, and every
        # run must pay its whole prompt pass as the first did, or repeats would time another thing.
        return {v.name: LLM(target, speculative_config=v.spec(drafts.get(v.draft)), dtype=c.dtype, device=c.device,
                            max_model_len=c.max_model_len, max_num_seqs=1, enable_prefix_caching=False)
                for v in c.variants}

    def _params(self, seed: int | None, max_tokens: int | None = None) -> SamplingParams:
        c = self.config
        return SamplingParams(max_tokens=max_tokens or c.max_tokens, temperature=c.temperature, top_p=c.top_p,
                              top_k=c.top_k, seed=seed, ignore_eos=c.ignore_eos)

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> dict:
        c = self.config
        started, phases = time.time(), {}
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + now - clock
            clock = now

        prompts = self.prompts()
        dtype = EngineConfig(model=c.model, dtype=c.dtype).torch_dtype
        target = load_model(c.model, dtype, c.device, c.quantization)
        # each draft loaded once, shared by every K
        names = dict.fromkeys(v.draft for v in c.variants if v.draft)
        drafts = {name: load_model(name, dtype, c.device, c.quantization) for name in names}
        draft = next(iter(drafts.values()), None)  # the one the peers get
        engines = self._engines(target, drafts)
        lap("load_s")
        if c.repeats > 1 and any(v.method == "suffix" for v in c.variants):
            self.notes.append("suffix's repeats after the first draft from its own earlier answer to the same "
                              "request (its global cache): a repeated request's figures, not a new one's")
        requests, runs, divergences, tv = self._measure(prompts, engines, lap)
        decoder = engines["none"].engine.decoder
        probes = []  # (the bandwidth probe beside each plain run, its tokens/s)
        for r in runs:
            if "bandwidth" in r:
                bw = r.pop("bandwidth")
                r["bandwidth_gb_per_s"] = bw["bandwidth_bytes_per_s"] / 1e9
                probes.append((bw, r["tokens_per_second"]))
        memory = {name: self._model_bytes(llm) / MIB for name, llm in engines.items()}
        result = {
            "config": c.to_dict(),
            "models": {"target": _model_info(target), "draft": _model_info(draft) if draft else None,
                       "drafts": {name: _model_info(m) for name, m in drafts.items()}},  # each one compared
            "floor": floor(probes or [(measure_bandwidth(), None)], decoder.weight_bytes_per_token()),
            "requests": [r.to_dict() for r in requests], "runs": runs,
            "divergences": divergences, "tv_tests": tv, "model_mib": memory,
            "batch_invariance": decoder.batch_invariance.to_dict(),
        }
        eos = set(target.config.eos_token_ids)
        target_source, draft_source = target.source, draft.source if draft else None
        del engines, decoder, target, draft, drafts  # the peers load their own copies
        gc.collect()
        if c.peers:
            from quickdraft.bench import peers

            result["peers"] = peers.run_peers(c, target_source, draft_source, eos, requests, runs, self.notes,
                                              self.progress)
            lap("peers_s")
        result["notes"] = self.notes
        result["phases"] = phases
        result["duration_s"] = time.time() - started
        result["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started))
        return result

    def _model_bytes(self, llm) -> int:
        """Weights and KV caches this variant needs on its own (target, draft when it has one),
        each counted once: layer_skip's draft is the target, with its cache and weights (and a
        head of its own when truncated)."""
        eng, proposer = llm.engine, llm.engine.proposer
        held = {}  # id -> tensor or quantized weight
        for kv in (eng.kv, getattr(proposer, "kv", None)):
            held.update((id(t), t) for t in (kv.keys + kv.values if kv is not None else []))
        held.update((id(t), t) for t in eng.model.weights.values())
        draft = getattr(proposer, "model", None)
        if draft is not None:
            held.update((id(t), t) for t in draft.w.values())
        head = getattr(proposer, "head", None)
        trained = [m for m in (head, getattr(proposer, "heads", None)) if isinstance(m, torch.nn.Module)]
        if head is not None and head is not getattr(draft, "lm_head", None) and not trained:
            held[id(head)] = head
        for name in ("keys", "values"):  # a trained head's own KV cache (eagle3)
            if isinstance(getattr(proposer, name, None), torch.Tensor):
                held[id(getattr(proposer, name))] = getattr(proposer, name)
        return sum(nbytes(t) for t in held.values()) + sum(head_bytes(m) for m in trained)

    def _measure(self, prompts, engines, lap: Callable[[str], None]):
        from tqdm import tqdm

        c = self.config
        names = list(engines)
        seeds = [c.seed + i for i in range(c.num_seeds)] if not c.greedy else [c.seed]
        repeats = c.repeats if c.greedy else 1
        total = sum(p.num_turns for p in prompts) * len(names) * len(seeds) * repeats
        tok = engines["none"].tokenizer
        first = tok.encode(datasets.render(prompts[0], tok, []))
        for llm in engines.values():  # warm-up: kernels, allocator, the draft's first pass
            llm.generate([first], self._params(c.seed, c.warmup_tokens))
        lap("warmup_s")
        requests, runs, divergences, tv = [], [], [], []
        margins: dict = {}
        bar = tqdm(total=total, desc="bench", unit="run", disable=not self.progress, dynamic_ncols=True)
        for p in prompts:
            answers: list[str] = []
            for turn in range(p.num_turns):
                text = datasets.render(p, tok, answers)
                ids = tok.encode(text)
                req = Request(f"{p.dataset}/{p.id}#{turn + 1}", p.dataset, p.category, p.id, turn + 1, text, ids)
                if len(ids) + 1 >= c.max_model_len:
                    self.notes.append(f"skipped {req.id}: {len(ids)} prompt tokens leave no room in "
                                      f"--max-model-len {c.max_model_len}")
                    bar.update(len(names) * len(seeds) * repeats * (p.num_turns - turn))
                    break
                requests.append(req)
                block = []
                for rep in range(repeats):
                    for seed in seeds:
                        rot = (len(requests) + rep + seed) % len(names)
                        for name in names[rot:] + names[:rot]:
                            bar.set_postfix_str(f"{req.id} {name}"[:60], refresh=False)
                            # the memory's pace beside each plain run: it drifts on a shared machine (floor.py)
                            probe = measure_bandwidth(PROBE_MIB, PROBE_REPEATS) if name == "none" else None
                            run = timed_generate(engines[name], ids, self._params(seed))
                            block.append({"request": req.id, "variant": name, "seed": seed, "repeat": rep, **run,
                                          **({"bandwidth": probe} if probe else {})})
                            bar.update(1)
                runs += block
                base = next(r for r in block if r["variant"] == "none" and r["seed"] == seeds[0] and r["repeat"] == 0)
                answers.append(base["text"])
                if c.greedy:
                    divergences += self._divergences(engines["none"].engine.decoder, req, block, margins)
                else:
                    tv += self._tv(req, block)
                lap("measure_s")
        bar.close()
        return requests, runs, divergences, tv

    def _divergences(self, decoder, req: Request, block: list[dict], margins: dict) -> list[dict]:
        """Every greedy run whose tokens differ from ``none``'s (same repeat), with the margin."""
        base = {r["repeat"]: r["token_ids"] for r in block if r["variant"] == "none"}
        out = []
        for r in block:
            ref = base[r["repeat"] if r["variant"] != "none" else 0]
            at = stats.first_divergence(ref, r["token_ids"])
            r["identical_to_none"] = at is None
            if at is None:
                continue
            prefix = tuple(req.prompt_token_ids + ref[:at])
            if prefix not in margins:
                margins[prefix] = top2_margin(decoder, list(prefix))
            tokens = {"none_token": ref[at] if at < len(ref) else None,
                      "variant_token": r["token_ids"][at] if at < len(r["token_ids"]) else None}
            out.append({"request": req.id, "variant": r["variant"], "repeat": r["repeat"], "position": at,
                        **tokens, **margins[prefix]})
        return out

    def _tv(self, req: Request, block: list[dict]) -> list[dict]:
        c = self.config
        by_variant: dict[str, list[list[int]]] = {}
        for r in block:
            by_variant.setdefault(r["variant"], []).append(r["token_ids"])
        base = by_variant["none"]
        return [{"request": req.id, "variant": name,
                 **stats.tv_test(seqs, base, c.max_tokens, c.permutations, c.seed).to_dict()}
                for name, seqs in by_variant.items() if name != "none"]


def _model_info(m: LoadedModel) -> dict:
    cfg = m.config
    return {"name": cfg.name, "source": m.source, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "weight_bytes": sum(nbytes(t) for t in m.weights.values()),
            "dtype": str(activation_dtype(cfg, m.weights)).replace("torch.", ""),
            "formats": sorted({getattr(t, "ggml_type", None) or str(t.dtype).replace("torch.", "")
                               for n, t in m.weights.items() if n.endswith("proj.weight")})}
