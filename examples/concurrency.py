"""Throughput at a concurrency, plain decoding against a speculative configuration: the same
HumanEval prompts, max_num_seqs requests at a time (the engine's continuous batching), pairs
interleaved (plain, speculative, plain, ...) so that a machine whose speed drifts falls on both alike,
each run in a fresh process (the adaptive plan starts cold in each). Prints each run and the median
of the pairs' ratios; checks that every speculative output equals its plain one.

    python examples/concurrency.py --model qwen2.5-coder-1.5b-instruct --concurrency 1 2 4 8 \\
        --speculative-config '{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}'
"""
import argparse
import json
import statistics
import subprocess
import sys
import time


def child(model: str, spec: str | None, concurrency: int, prompts: int, max_tokens: int) -> None:
    from quickdraft import LLM, SamplingParams
    from quickdraft.evaluation.datasets import humaneval

    llm = LLM(model, speculative_config=json.loads(spec) if spec else None, max_num_seqs=concurrency)
    texts = [p.prompt for p in humaneval(prompts)]
    llm.generate(texts[:1], SamplingParams(max_tokens=8, temperature=0))  # kernels and allocator warm
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(texts, params)
    seconds = time.perf_counter() - started
    switch = getattr(llm.engine, "switch", None)
    print(json.dumps({"tok_s": sum(len(o.token_ids) for o in outs) / seconds, "outputs": [o.token_ids for o in outs],
                      "draft_tokens": sum(o.spec.num_draft_tokens for o in outs),
                      "switch": switch.to_dict() if switch else None}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--speculative-config", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.model, args.speculative_config or None, args.concurrency[0], args.prompts, args.max_tokens)
        return 0
    ok = True
    for c in args.concurrency:
        ratios = []
        for _ in range(args.pairs):
            runs = []
            for spec in ("", args.speculative_config):
                out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--speculative-config",
                                      spec, "--concurrency", str(c), "--prompts", str(args.prompts), "--max-tokens",
                                      str(args.max_tokens)], capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            plain, spec = runs
            same = plain["outputs"] == spec["outputs"]
            ok &= same
            ratios.append(spec["tok_s"] / plain["tok_s"])
            print(f"concurrency {c}: plain {plain['tok_s']:.2f} tok/s, speculative {spec['tok_s']:.2f} tok/s "
                  f"({ratios[-1]:.2f}x, {spec['draft_tokens']} draft tokens){'' if same else ', OUTPUTS DIFFER'}",
                  flush=True)
        print(f"concurrency {c}: median {statistics.median(ratios):.2f}x over {len(ratios)} pairs", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
