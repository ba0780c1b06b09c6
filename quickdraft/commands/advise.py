"""``quickdraft advise``: the rollout checklist for speculative decoding, as one command, on the
user's own prompts and this machine.

The checklist (the order production guides give it in): measure a baseline; choose the drafter by
measured acceptance on your own prompts; let K follow the measurements; know the memory at your
batch size; speculate only where a verification pass has headroom, answers are long enough, and
the drafter fits. ``advise`` does each step with measured inputs:

1. baseline: plain decoding of the prompts, tokens/s, time to first token, memory;
2. each available drafter (``ngram``, ``suffix``, the draft models named with ``--draft-model``)
   with the engine's adaptive planner choosing K up to ``--max-num-speculative-tokens`` (the planner's
   K): acceptance by position, tokens per target pass, and speedup over the baseline at each batch
   size (static batches of that many requests, baseline and drafters interleaved wave by wave,
   the speedup the median of the waves' ratios), each engine warmed up past the plan's cold start;
3. the memory each drafter adds: weights, KV cache, and the scratch of a verification pass;
4. the verdict: "speculate with X" and a ready ``--speculative-config`` (speculation turned off
   from the first batch size where it measured a loss), or "don't, because Y".

``quickdraft profile`` stays the cost-only view (predictions from timed passes, no prompts);
``advise`` reads its cost model for the headroom and measures everything else. The report
(markdown, plots and JSON) is written by advise_report.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from quickdraft.arguments import add_dtype_arg, add_flag, add_model_positional, add_switch, numbers
from quickdraft.engine.sequence import SpecStats
from quickdraft.errors import ConfigError
from quickdraft.evaluation.stats import median

BATCH_SIZES = (1, 4, 8)
MIN_SPEEDUP = 1.10  # below this at batch 1 the gain is within this machine's noise: not worth a rollout
SHORT_ANSWER = 32  # median output tokens under which the prompt pass dominates a request
# the warm-up each engine runs before it is measured: text of its own (a code task and a chat
# question), long enough for the adaptive plan to leave its cold start
WARMUP_PROMPTS = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                  "Question: name the four seasons and say what each is like.\nAnswer:")
WARMUP_TOKENS = 48
SUFFIX_BYTES_PER_TOKEN_LEVEL = 55  # config.py: the suffix trie's worst case, a token a level of depth


@dataclass
class Drafter:
    """One speculative configuration to measure: a name for the report and its spec (None: the baseline)."""

    name: str
    spec: dict | None


@dataclass
class Run:
    """A variant's measurements at one batch size."""

    batch: int
    requests: int
    tokens: int
    seconds: float
    ttft_s: list[float]
    tpot_s: list[float]
    lengths: list[int] = field(default_factory=list)  # [requests] output tokens
    stats: SpecStats = field(default_factory=SpecStats)
    wave_rates: list[float] = field(default_factory=list)  # [waves] each wave's tokens per second

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        s = self.stats
        drafts = s.drafts_per_position[0] if s.drafts_per_position else 0
        return {"batch": self.batch, "requests": self.requests, "tokens": self.tokens, "seconds": self.seconds,
                "tokens_per_second": self.tokens_per_second,
                "ttft_p50_s": median(self.ttft_s) if self.ttft_s else None,
                "tpot_p50_s": median(self.tpot_s) if self.tpot_s else None,
                "mean_draft_length": s.num_draft_tokens / drafts if drafts else 0.0, **s.to_dict()}


def speedup(run: "Run", base: "Run") -> float:
    """The median over waves of a variant's tokens per second over the baseline's on the same wave:
    each wave ran beside its baseline, so a load that came and went falls out of each ratio, and the
    median leaves out a wave that a burst of other work hit."""
    ratios = [r / b for r, b in zip(run.wave_rates, base.wave_rates) if b > 0]
    return median(ratios) if ratios else run.tokens_per_second / max(base.tokens_per_second, 1e-9)


def drafters(methods: list[str], draft_models: list[str], k: int) -> list[Drafter]:
    out = [Drafter("none", None)]
    for m in methods:
        if m == "draft_model":
            continue  # one per --draft-model
        if m not in ("ngram", "suffix"):
            raise ConfigError(f"advise measures ngram, suffix and draft models (--draft-model), not {m!r}", "methods")
        out.append(Drafter(m, {"method": m, "num_speculative_tokens": k}))
    for d in draft_models:
        out.append(Drafter(f"draft_model ({d})", {"method": "draft_model", "model": d, "num_speculative_tokens": k}))
    if len(out) == 1:
        raise ConfigError("nothing to compare: give --methods and/or --draft-model", "methods")
    return out


def waves(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """The prompts cycled into static batches of ``batch`` requests, at least every prompt once."""
    n = -(-max(len(prompts), batch) // batch) * batch
    todo = [prompts[i % len(prompts)] for i in range(n)]
    return [todo[i : i + batch] for i in range(0, n, batch)]


def run_wave(engine, wave: list[list[int]], params, run: "Run") -> None:
    """One static batch of requests to its end, added to ``run``."""
    started = time.perf_counter()
    outs = engine.generate_ids(wave, [params] * len(wave))
    seconds = time.perf_counter() - started
    run.seconds += seconds
    run.wave_rates.append(sum(len(o.token_ids) for o in outs) / seconds if seconds > 0 else 0.0)
    for o in outs:
        run.requests += 1
        run.tokens += len(o.token_ids)
        run.lengths.append(len(o.token_ids))
        run.stats.merge(o.spec)
        if o.first_token_time is not None:
            run.ttft_s.append(o.first_token_time - o.arrival_time)
            if len(o.token_ids) > 1 and o.finish_time is not None:
                run.tpot_s.append((o.finish_time - o.first_token_time) / (len(o.token_ids) - 1))


def memory(engine, context: int, batch: int, k: int) -> dict:
    """Bytes a variant needs at ``batch`` sequences of ``context`` tokens: the target's weights and
    KV, and what its proposer adds (draft weights and KV, the suffix trie's bound), and the scratch
    of one pass: plain decoding's ``batch`` rows, a verification pass's ``batch * (K + 1)``
    (estimated from shapes: float32 logits and the layer's widest activations, per row)."""
    from quickdraft.models.decoder import nbytes
    from quickdraft.models.kv_cache import KVCache

    def scratch(config, rows: int, itemsize: int) -> int:
        return rows * (4 * config.vocab_size + itemsize * (4 * config.hidden_size + 3 * config.intermediate_size))

    cfg, dtype = engine.model.config, engine.config.torch_dtype
    itemsize = engine.kv.keys[0].element_size()
    out = {"target_weights": sum(nbytes(t) for t in engine.model.weights.values()),
           "target_kv": KVCache.bytes_per_token(cfg, dtype) * context * batch,
           "plain_scratch": scratch(cfg, batch, itemsize)}
    spec = engine.config.speculative
    draft = getattr(engine.proposer, "model", None)
    extra = {"draft_weights": 0, "draft_kv": 0, "verify_scratch": 0, "proposer_state": 0}
    if spec.enabled:
        extra["verify_scratch"] = scratch(cfg, batch * (k + 1), itemsize) - out["plain_scratch"]
    if draft is not None:
        extra["draft_weights"] = sum(nbytes(t) for t in draft.w.values())
        extra["draft_kv"] = KVCache.bytes_per_token(draft.config, dtype) * context * batch
        extra["verify_scratch"] += scratch(draft.config, batch, itemsize)  # the draft's own passes
    if spec.method == "suffix":
        extra["proposer_state"] = (spec.suffix_decoding_max_cached_tokens * spec.suffix_decoding_max_tree_depth
                                   * SUFFIX_BYTES_PER_TOKEN_LEVEL)
    out.update(extra)
    out["added"] = sum(extra.values())
    return out


def headroom(target_cost, k: int, batch: int, context: int) -> float | None:
    """What a verification pass of K + 1 rows a sequence costs over a plain decoding step of one
    row a sequence, at ``batch`` sequences, by the engine's calibrated cost model (models/pass_cost.py).
    Near 1: verification is nearly free (memory-bound), the headroom speculation lives on."""
    from quickdraft.models.pass_cost import key_reads

    if target_cost is None:
        return None
    plain = target_cost(batch, batch, batch * key_reads(context, 1))
    return target_cost(batch * (k + 1), batch, batch * key_reads(context, k + 1)) / plain


def decide(result: dict, budget: int | None) -> dict:
    """The decision framework on measured inputs -> {"speculate": bool, "drafter", "reasons",
    "speculative_config"}. A drafter qualifies when what it adds fits ``budget`` (bytes; None: no
    limit known) and its batch-1 speedup reaches MIN_SPEEDUP; the best qualifying one by that
    speedup is chosen, and speculation is turned off from the first batch size where it lost. A
    speedup above the drafter's tokens per target pass cannot be real (a pass costs at least a plain
    step) and is counted as that many tokens a pass."""
    base = result["baseline"]
    answer = base["answer_tokens_p50"]
    reasons, candidates = [], []
    for d in result["drafters"]:
        speedups = {int(b): s for b, s in d["speedup"].items()}
        added = max(m["added"] for m in d["memory"].values())
        if budget is not None and added > budget:
            reasons.append(f"{d['name']} adds {added / 2**20:.0f} MiB, more than the {budget / 2**20:.0f} MiB free")
            continue
        first, per_pass = speedups[min(speedups)], d["runs"][0]["mean_accepted_length"]
        if first > per_pass:  # a pass emits per_pass tokens and costs at least a plain step: the rest is noise
            reasons.append(f"{d['name']} measured {first:.2f}x at batch {min(speedups)}, but with "
                           f"{per_pass:.2f} tokens a pass it cannot beat {per_pass:.2f}x: counted as that")
            first = per_pass
        if first < MIN_SPEEDUP:
            reasons.append(f"{d['name']} measured {first:.2f}x at batch {min(speedups)} "
                           f"(acceptance {d['runs'][0]['acceptance_rate']:.0%}, "
                           f"{per_pass:.2f} tokens a pass), under {MIN_SPEEDUP:.2f}x")
            continue
        candidates.append((first, d, speedups))
    h = result.get("headroom")
    if h:
        reasons.append(f"a verification pass of K + 1 rows costs {h:.2f}x a plain step at batch 1 on this machine")
    if answer < SHORT_ANSWER:
        reasons.append(f"answers are short (median {answer:.0f} tokens): the prompt pass dominates, "
                       "which speculation does not shorten")
    if not candidates:
        return {"speculate": False, "drafter": None, "reasons": reasons, "speculative_config": None,
                "text": "don't speculate: " + "; ".join(reasons)}
    best_speedup, best, speedups = max(candidates, key=lambda c: c[0])
    config = dict(best["spec"])
    losing = sorted(b for b, s in speedups.items() if s < 1.0)
    if losing:
        config["disable_by_batch_size"] = losing[0]
    text = (f"speculate with {best['name']}: "
            + ", ".join(f"{s:.2f}x at {'batch ' if b == min(speedups) else ''}{b}" for b, s in sorted(speedups.items()))
            + (f"; off from batch {losing[0]}, where it measured a loss" if losing else ""))
    return {"speculate": True, "drafter": best["name"], "reasons": reasons, "speculative_config": config, "text": text}


def measure(model, prompts: list[list[int]], variants: list[Drafter], batches, params, k: int, dtype: str,
            device: str, max_model_len: int, progress: bool = True) -> dict:
    """Every variant at every batch size, interleaved (each wave of requests by each variant in
    turn), after a warm-up of each; -> the result that ``decide`` and the report read."""
    from tqdm import tqdm

    from quickdraft import LLM, SamplingParams
    from quickdraft.evaluation.measure import RssSampler

    def engines():
        # Fresh engines for each batch size, warmed up on text of their own: no drafter may learn
        # from an earlier run of the same prompts (suffix's global cache would). The prefix cache
        # stays off: the prompts are cycled into waves, and a repeat must cost what the first did.
        out = {v.name: LLM(model, speculative_config=v.spec, dtype=dtype, device=device, max_model_len=max_model_len,
                           max_num_seqs=max(batches), enable_prefix_caching=False).engine for v in variants}
        # kernels, allocator, and the adaptive plan's cold start: the refit of both cost models and
        # the acceptance seen, on text that is not the user's (advise measures each drafter as a
        # server that has run a while serves it)
        for engine in out.values():
            engine.generate_ids(warmup, [SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0, ignore_eos=True)]
                                * len(warmup))
        return out

    warmup = [model.tokenizer.encode(text) for text in WARMUP_PROMPTS]
    total = len(variants) * sum(len(waves(prompts, b)) for b in batches)
    bar = tqdm(total=total, desc="advise", unit="batch", disable=not progress, dynamic_ncols=True)
    runs: dict[str, list[Run]] = {v.name: [] for v in variants}
    peak = {v.name: 0 for v in variants}
    for b in batches:
        built = engines()
        for v in variants:
            runs[v.name].append(Run(b, 0, 0, 0.0, [], []))
        # each wave by every variant in turn: a load that comes and goes on a shared machine
        # falls on all of them alike
        for wave in waves(prompts, b):
            for v in variants:
                with RssSampler() as rss:
                    run_wave(built[v.name], wave, params, runs[v.name][-1])
                peak[v.name] = max(peak[v.name], rss.peak)
                bar.update(1)
    bar.close()
    base = runs["none"]
    lengths = base[0].lengths  # each request's output tokens (the smallest batch)
    context = max(len(p) for p in prompts) + params.max_tokens
    none_engine = built["none"]
    spec_engine = next((built[v.name] for v in variants if v.spec is not None), None)
    result = {
        "baseline": {"runs": [r.to_dict() for r in base], "answer_tokens_p50": median(lengths) if lengths else 0.0,
                     "memory": {str(b): memory(none_engine, context, b, k) for b in batches},
                     "peak_rss_mib": peak["none"] / 2**20},
        "drafters": [],
        "headroom": headroom(spec_engine.runner.target_cost if spec_engine else None, k, 1, context),
        "context_tokens": context,
    }
    for v in variants[1:]:
        mine = runs[v.name]
        result["drafters"].append({
            "name": v.name, "spec": v.spec, "runs": [r.to_dict() for r in mine],
            "speedup": {str(r.batch): speedup(r, b) for r, b in zip(mine, base)},
            "memory": {str(b): memory(built[v.name], context, b, k) for b in batches},
            "peak_rss_mib": peak[v.name] / 2**20,
        })
    return result


def register(sub) -> None:
    p = sub.add_parser("advise", help="the rollout checklist on your prompts: baseline, each drafter, memory, a verdict")
    add_model_positional(p)
    p.add_argument("prompts", help="a JSONL of your prompts (bench's format: \"prompt\", \"messages\" or \"turns\" a "
                                   "line), or humaneval / mtbench; chats are asked their first turn")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a built-in name (see `quickdraft models`), a .gguf file or a Hugging Face directory")
    p.add_argument("--draft-model", action="append", default=[], help="a draft model to measure (repeatable)")
    p.add_argument("--methods", default="ngram,suffix", help="model-free drafters to measure, comma-separated")
    add_flag(p, "--max-num-speculative-tokens", dest="num_speculative_tokens", type=int, default=8,
             deprecated=("--num-speculative-tokens",), help="the most K the planner may choose")
    add_flag(p, "--batch-size", default=",".join(map(str, BATCH_SIZES)), deprecated=("--batch-sizes",),
             help="requests in a static batch, comma-separated: each is measured")
    add_flag(p, "--num-prompts", type=int, default=10, deprecated=("--limit",),
             help="prompts to use (round-robin over categories; 0 = all)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate a request, at most")
    add_dtype_arg(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--memory-budget-mib", type=float, default=None,
                   help="memory a drafter may add (default: what /proc/meminfo says is available)")
    add_flag(p, "--result-dir", default="advise-out", deprecated=("--out",),
             help="a directory for report.md, its plots and results.json")
    add_switch(p, "--progress", default=True, help="a progress bar")
    p.set_defaults(func=advise)


def command(args) -> str:
    """The command line that reproduces this run, every setting spelled out."""
    import shlex

    words = ["quickdraft", "advise", args.prompts, "--model", args.model]
    for d in args.draft_model:
        words += ["--draft-model", d]
    words += ["--methods", args.methods, "--max-num-speculative-tokens", str(args.num_speculative_tokens),
              "--batch-size", args.batch_size, "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
              "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    return shlex.join(words)


def advise(args) -> int:
    import json
    import sys
    from pathlib import Path

    import torch

    from quickdraft import SamplingParams
    from quickdraft.commands.advise_report import write
    from quickdraft.evaluation import datasets
    from quickdraft.kernels import cpu_model
    from quickdraft.models.kv_cache import free_memory
    from quickdraft.models.loader import load_model

    started = time.time()
    batches = sorted(set(numbers(args.batch_size, int, "--batch-size")))
    if not batches or batches[0] < 1:
        raise ConfigError("--batch-size must be integers >= 1", "batch_size")
    if args.max_tokens < 2:
        raise ConfigError("--max-tokens must be >= 2", "max_tokens")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    variants = drafters(methods, args.draft_model, args.num_speculative_tokens)
    model = load_model(args.model, getattr(torch, args.dtype), args.device)
    rows = datasets.load(args.prompts, args.num_prompts or None)
    prompts = [model.tokenizer.encode(datasets.render(p, model.tokenizer, [])) for p in rows]
    room = args.max_model_len - args.max_tokens - args.num_speculative_tokens - 1
    kept = [p for p in prompts if len(p) <= room]
    if not kept:
        raise ConfigError(f"every prompt is longer than --max-model-len {args.max_model_len} leaves room for", "prompts")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    result = measure(model, kept, variants, batches, params, args.num_speculative_tokens, args.dtype, args.device,
                     args.max_model_len, progress=args.progress)
    budget = int(args.memory_budget_mib * 2**20) if args.memory_budget_mib is not None else free_memory()
    result.update({
        "model": args.model, "prompts_source": Path(args.prompts).name, "num_prompts": len(kept),
        "skipped_prompts": len(prompts) - len(kept), "max_tokens": args.max_tokens, "dtype": args.dtype,
        "k": args.num_speculative_tokens, "batch_sizes": batches, "memory_budget_bytes": budget,
        "machine": f"{cpu_model()}, {torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''}",
        "command": command(args),
        "duration_s": time.time() - started,
    })
    result["verdict"] = decide(result, budget)
    report = write(result, Path(args.result_dir))
    print(result["verdict"]["text"])
    if result["verdict"]["speculative_config"]:
        print(f"--speculative-config '{json.dumps(result['verdict']['speculative_config'])}'")
    print(f"report: {report}", file=sys.stderr)
    return 0
