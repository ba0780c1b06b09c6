"""``quickdraft check``: is speculative decoding lossless on this machine, for this model and config?

Three checks, each reported with the figures behind it:

1. *kernels*: every projection the target runs (and its output head, and the whole decoder) is
   probed for batch invariance over 1..64 rows (models/invariance.py). A path that promises
   invariance and breaks it fails; a path that promises nothing (a CPU without the instructions,
   ``QUICKDRAFT_KERNELS=0``, CUDA) is a warning: then only the prompts can tell.
2. *greedy*: each prompt decoded plainly (method none, alone), and speculatively, all prompts in
   one batch as a server would run them. The tokens must be identical; at a divergence the check
   names the first diverging position and the target's margin between its top two logits there
   (evaluation/measure.py's top2_margin), so that a near-tie can be told from a wrong token.
3. *sampled*: a few prompts over many seeds at temperature > 0, plain and speculative, compared by
   the per-position TV permutation test the bench uses too (evaluation/stats.py), p values combined by Fisher's
   method. It fails when the combined p value is below ``--alpha``: a test of the output
   distribution, which rejection sampling must keep exactly.

Only the target's rounding can change the output (a draft only proposes), so only the target is
probed. The target is loaded once and shared by both engines; a draft named like the target
shares its weights too. K is fixed at ``num_speculative_tokens`` (``adaptive`` off), so that every
step verifies drafts.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from quickdraft.evaluation.datasets import Prompt
from quickdraft.models.ggml import on_blocks

ALPHA = 0.001  # the sampled check fails below this combined p value
SLOTS = 16  # sequences decoding at once in the batched runs
PROBE_ROWS = 64


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


BUILTIN = [
    Prompt("code", "coding", prompt='def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    Prompt("repeat", "repetition", prompt="The capital of France is Paris. The capital of Italy is Rome. The capital "
           "of Spain is Madrid. The capital of France is Paris. The capital of Italy is"),
    Prompt("primes", "chat", messages=_user("List the prime numbers below 50, separated by commas.")),
    Prompt("pets", "chat", messages=_user("Suggest three names for a pet turtle, one per line.")),
    Prompt("code-chat", "coding", messages=_user("Write a Python function that says if a string is a palindrome.")),
    Prompt("story", "prose", prompt="Once upon a time, in a small village by the sea,"),
]
SAMPLED = ("repeat", "code", "primes")  # for the sampled check: drafts get accepted, prompts are short


def register(sub) -> None:
    from quickdraft.arguments import add_flag, add_switch, add_model_args

    p = sub.add_parser("check", help="check on this machine that speculative output equals plain decoding")
    add_model_args(p, max_model_len="the longest prompt and output the check runs")
    p.add_argument("--prompts", help='a JSONL file: one object a line with "prompt" or "messages" (default: built-in)')
    p.add_argument("--num-prompts", type=int, default=None, help="use at most this many prompts")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per greedy generation")
    p.add_argument("--temperature", type=float, default=0.8, help="of the sampled check (> 0)")
    add_flag(p, "--num-seeds", type=int, default=64, deprecated=("--seeds",),
             help="samples per prompt in the sampled check; 0 skips it")
    add_flag(p, "--num-sampled-prompts", type=int, default=2, deprecated=("--sampled-prompts",),
             help="prompts in the sampled check")
    p.add_argument("--sample-tokens", type=int, default=8, help="tokens per sample in the sampled check")
    p.add_argument("--alpha", type=float, default=ALPHA, help="the sampled check fails below this p value")
    p.add_argument("--permutations", type=int, default=1000, help="of the TV permutation test")
    add_switch(p, "--json", help="print one JSON object")
    p.set_defaults(func=check)


def check(args) -> int:
    from tqdm import tqdm

    from quickdraft import LLM
    from quickdraft.config import EngineConfig, SpeculativeConfig
    from quickdraft.errors import ConfigError
    from quickdraft.evaluation.datasets import render, user_jsonl
    from quickdraft.models.loader import load_model

    spec = SpeculativeConfig.parse(args.speculative_config)
    if not spec.enabled:
        raise ConfigError('check needs --speculative-config with a method (e.g. {"method": "ngram"})',
                          "speculative_config")
    _validate(args)
    started = time.perf_counter()
    prompts = user_jsonl(args.prompts) if args.prompts else list(BUILTIN)
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    dtype = EngineConfig(model=args.model, dtype=args.dtype).torch_dtype
    target = load_model(args.model, dtype, args.device, quantization=args.quantization)
    # K fixed: the adaptive planner may choose K = 0 where drafts do not pay, and would leave the
    # verification path unchecked; which K runs changes only the speed (tests/engine).
    spec = dataclasses.replace(spec, adaptive=False)
    if spec.method == "draft_model" and spec.model == args.model:
        spec = dataclasses.replace(spec, model=target)
    if not args.prompts and target.tokenizer is not None and target.tokenizer.chat_template is None:
        # a base model (Gemma 3 270M): the built-in chats' questions go in as plain text
        prompts = [p if p.prompt is not None else dataclasses.replace(p, prompt=p.messages[-1]["content"], messages=[])
                   for p in prompts]
    texts = [render(p, target.tokenizer, []) for p in prompts]
    ids = [target.tokenizer.encode(t) for t in texts]
    longest = max(len(i) for i in ids) + max(args.max_tokens, args.sample_tokens) + spec.num_speculative_tokens + 1
    common = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len or longest, max_num_seqs=SLOTS,
                  quantization=args.quantization)
    plain, speculative = LLM(target, **common), LLM(target, speculative_config=spec, **common)
    decoder = plain.engine.decoder
    sampled = _sampled_indices(prompts, args) if args.num_seeds else []
    total = 2 * len(prompts) + 2 * len(sampled) * args.num_seeds
    bar = tqdm(total=total, desc="check", unit="run", file=sys.stderr, dynamic_ncols=True)
    bar.set_postfix_str("probing kernels")
    kernels = probe_kernels(decoder)
    greedy = check_greedy(plain, speculative, decoder, prompts, ids, args.max_tokens, bar)
    sample = check_sampled(plain, speculative, [prompts[i] for i in sampled], [ids[i] for i in sampled], args, bar)
    bar.close()
    result = {"model": args.model, "dtype": args.dtype, "device": args.device,
              "quantization": "gguf" if on_blocks(target.weights) else None,
              "speculative": {**spec.__dict__, "model": _name(spec.model)}, "kernels": kernels, "greedy": greedy,
              "sampled": sample}
    result.update(verdict(result, args.alpha))
    result["seconds"] = time.perf_counter() - started
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0 if result["verdict"] == "PASS" else 1


def _validate(args) -> None:
    from quickdraft.errors import ConfigError

    if args.max_tokens < 1 or args.sample_tokens < 1:
        raise ConfigError("--max-tokens and --sample-tokens must be >= 1")
    if args.num_seeds < 0 or args.num_sampled_prompts < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        raise ConfigError("--num-seeds must be >= 0, --num-sampled-prompts and --num-prompts >= 1")
    if args.num_seeds and not 0 < args.temperature <= 100:
        raise ConfigError(f"--temperature must be in (0, 100] for the sampled check, got {args.temperature}")
    if not 0 < args.alpha < 1:
        raise ConfigError(f"--alpha must be in (0, 1), got {args.alpha}")
    if 1 / (args.permutations + 1) >= args.alpha:  # the smallest p value a permutation test gives
        raise ConfigError(f"--permutations must be at least {int(1 / args.alpha)} for --alpha {args.alpha}, "
                          "or no test could fail")


def _sampled_indices(prompts: list[Prompt], args) -> list[int]:
    """The built-in prompts chosen for sampling, else the user's first ones."""
    order = [i for name in SAMPLED for i, p in enumerate(prompts) if p.id == name and p.dataset == ""]
    order += [i for i in range(len(prompts)) if i not in order]
    return order[: args.num_sampled_prompts]


def _name(model) -> str | None:
    return model if model is None or isinstance(model, str) else model.source


# -- the three checks ---------------------------------------------------------------------------

def probe_kernels(decoder) -> dict:
    """What the target's kernel path promises here, and what the probes find."""
    from quickdraft.models.invariance import probe

    started = time.perf_counter()
    probes = [p.to_dict() for p in probe(decoder, PROBE_ROWS)]
    return {"promise": decoder.batch_invariance.to_dict(), "max_rows": PROBE_ROWS, "probes": probes,
            "invariant": all(p["invariant"] for p in probes), "seconds": time.perf_counter() - started}


def check_greedy(plain, speculative, decoder, prompts, ids, max_tokens: int, bar) -> dict:
    """Plain decoding of each prompt alone against speculative decoding of all of them at once."""
    from quickdraft.evaluation.measure import top2_margin
    from quickdraft.evaluation.stats import first_divergence
    from quickdraft.sampling import SamplingParams

    started = time.perf_counter()
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    ref = []
    for p, i in zip(prompts, ids):
        bar.set_postfix_str(f"greedy plain {p.id}"[:40])
        ref.append(plain.generate([i], params)[0].token_ids)
        bar.update(1)
    bar.set_postfix_str("greedy speculative")
    outs = speculative.generate(ids, params)
    bar.update(len(ids))
    rows = []
    for p, i, a, out in zip(prompts, ids, ref, outs):
        b = out.token_ids
        at = first_divergence(a, b)
        row = {"prompt": p.id, "num_prompt_tokens": len(i), "num_tokens": len(a), "identical": at is None,
               "num_draft_tokens": out.spec.num_draft_tokens, "num_accepted_tokens": out.spec.num_accepted_tokens}
        if at is not None:
            row.update(position=at, plain_token=a[at] if at < len(a) else None,
                       speculative_token=b[at] if at < len(b) else None, **top2_margin(decoder, i + a[:at]))
        rows.append(row)
    return {"max_tokens": max_tokens, "num_prompts": len(rows), "identical": sum(r["identical"] for r in rows),
            "prompts": rows, "seconds": time.perf_counter() - started}


def check_sampled(plain, speculative, prompts, ids, args, bar) -> dict | None:
    """Per prompt: ``args.num_seeds`` samples plain and speculative, one TV permutation test."""
    from quickdraft.evaluation.stats import combine_tv, tv_test
    from quickdraft.sampling import SamplingParams

    if not prompts:
        return None
    started = time.perf_counter()
    n = args.num_seeds
    # Independent samples: the two sides take different seeds. With the same seeds both would
    # draw their first token from the same uniform, and paired samples hide a difference.
    seeds = {"plain": range(n), "speculative": range(n, 2 * n)}
    rows, tests = [], []
    for p, i in zip(prompts, ids):
        runs = {}
        for name, llm in (("plain", plain), ("speculative", speculative)):
            bar.set_postfix_str(f"sampled {name} {p.id}"[:40])
            params = [SamplingParams(max_tokens=args.sample_tokens, temperature=args.temperature, seed=s)
                      for s in seeds[name]]
            runs[name] = llm.generate([i] * n, params)
            bar.update(n)
        test = tv_test([o.token_ids for o in runs["speculative"]], [o.token_ids for o in runs["plain"]],
                       args.sample_tokens, args.permutations, seed=0)
        tests.append(test)
        rows.append({"prompt": p.id, **test.to_dict(),
                     "num_draft_tokens": sum(o.spec.num_draft_tokens for o in runs["speculative"]),
                     "num_accepted_tokens": sum(o.spec.num_accepted_tokens for o in runs["speculative"])})
    return {"temperature": args.temperature, "seeds": args.num_seeds, "max_tokens": args.sample_tokens,
            "permutations": args.permutations, "alpha": args.alpha, "prompts": rows, **combine_tv(tests),
            "seconds": time.perf_counter() - started}


def verdict(result: dict, alpha: float) -> dict:
    """PASS unless a promised path breaks, a greedy output differs or the sampled test rejects."""
    failures, warnings = [], []
    k, g, s = result["kernels"], result["greedy"], result["sampled"]
    promise = k["promise"]
    bad = [f"{p['name']} (from {p['first_bad_rows']} rows)" for p in k["probes"] if not p["invariant"]]
    if not promise["promised"]:
        warnings.append(f"the {promise['path']} path promises no batch invariance: {promise['why']}")
    if bad:
        (failures if promise["promised"] else warnings).append(
            f"kernels: {', '.join(bad)} differ in a batch from the rows alone")
    if not sum(r["num_draft_tokens"] for r in g["prompts"]):
        warnings.append("greedy: no draft token was proposed, so the verification path went unchecked: "
                        "try prompts where the drafts hit")
    for r in g["prompts"]:
        if not r["identical"]:
            tie = " (a near-tie: within rounding)" if r["rounding_level"] else ""
            failures.append(f"greedy: prompt {r['prompt']!r} diverges at position {r['position']}: "
                            f"plain {r['plain_token']}, speculative {r['speculative_token']}, "
                            f"top-2 margin {r['margin']:.4g}{tie}")
    if s is not None and s["p_value"] < alpha:
        failures.append(f"sampled: TV {s['tv']:.3f} against {s['tv_null']:.3f} by chance, p = {s['p_value']:.2g} "
                        f"< {alpha}: the speculative distribution differs from the target's")
    return {"verdict": "FAIL" if failures else "PASS", "failures": failures, "warnings": warnings}


# -- the report ---------------------------------------------------------------------------------

def table(r: dict) -> str:
    spec = r["speculative"]
    k, g, s = r["kernels"], r["greedy"], r["sampled"]
    how = spec["method"] + (f" {spec['model']}" if spec["model"] else "") + f" K={spec['num_speculative_tokens']}"
    promise = k["promise"]
    width = max([16] + [len(p["path"]) + 1 for p in k["probes"]])
    weights = f" on its {r['quantization']} blocks" if r["quantization"] else ""
    lines = [f"quickdraft check: {r['model']}{weights}, {r['dtype']} on {r['device']}, {how}", "",
             f"kernels: {promise['path']}, {'promises' if promise['promised'] else 'does not promise'} batch "
             f"invariance ({promise['why']}); probed with 1..{k['max_rows']} rows in {k['seconds']:.1f}s",
             f"  {'op':18} {'shape':>12} {'path':{width}} result"]
    for p in k["probes"]:
        res = ("invariant" if p["invariant"] else
               f"differs from {p['first_bad_rows']} rows, max |diff| {p['max_abs_diff']:.3g}")
        lines.append(f"  {p['name']:18} {'x'.join(map(str, p['shape'])):>12} {p['path']:{width}} {res}")
    lines += ["", f"greedy: {g['identical']}/{g['num_prompts']} identical to plain decoding ({g['max_tokens']} tokens; "
              f"plain alone, speculative all prompts in one batch) in {g['seconds']:.0f}s",
              f"  {'prompt':14} {'tokens':>6} {'accepted':>10}  result"]
    for p in g["prompts"]:
        res = "identical" if p["identical"] else (
            f"diverges at {p['position']}: top-2 margin {p['margin']:.4g}"
            + (" (near-tie)" if p["rounding_level"] else ""))
        lines.append(f"  {p['prompt'][:14]:14} {p['num_tokens']:>6} "
                     f"{p['num_accepted_tokens']:>4}/{p['num_draft_tokens']:<5}  {res}")
    if s is None:
        lines += ["", "sampled: skipped (--num-seeds 0)"]
    else:
        lines += ["", f"sampled: T={s['temperature']}, {s['seeds']} seeds x {s['max_tokens']} tokens per prompt: "
                  f"per-position TV {s['tv']:.3f} vs {s['tv_null']:.3f} ± {s['tv_se']:.3f} by chance, "
                  f"p = {s['p_value']:.3g} (fails below {s['alpha']}) in {s['seconds']:.0f}s",
                  f"  {'prompt':14} {'TV':>6} {'null':>6} {'p':>6} {'accepted':>12}"]
        for p in s["prompts"]:
            lines.append(f"  {p['prompt'][:14]:14} {p['tv']:6.3f} {p['null_mean']:6.3f} {p['p_value']:6.3f} "
                         f"{p['num_accepted_tokens']:>5}/{p['num_draft_tokens']:<6}")
    lines += [""] + [f"warning: {w}" for w in r["warnings"]] + [f"failed: {f}" for f in r["failures"]]
    lines.append(f"verdict: {r['verdict']} in {r['seconds']:.0f}s" + (
        "" if r["failures"] else " (speculative output is the target's own on this machine)"))
    return "\n".join(lines)
