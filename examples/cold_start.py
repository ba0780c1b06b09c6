"""The adaptive plan on the first request of a fresh process, against fixed draft lengths: each
variant runs in a process of its own that has served nothing before (the plan starts cold), one
prompt, greedy, ``--max-tokens`` tokens; variants take turns prompt by prompt, for ``--rounds``
rounds. The adaptive plan runs twice: starting from the drafter's acceptance that earlier
processes kept in the cache (the adaptive runs before it), and from its neutral prior alone ("no
history"). The rate is the decoding's, tokens after the first over the time from the first token
to the last (the prompt's pass is the same work in every variant). Prints each run, and for each
prompt the adaptive plan's median against the best fixed K's; checks that every output is the same.

    python examples/cold_start.py --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \\
        --num-speculative-tokens 4 --fixed 2 3 4
"""
import argparse
import json
import math
import statistics
import subprocess
import sys


def child(model: str, spec: dict, prompt: str | list[dict], max_tokens: int, history: bool) -> None:
    from quickdraft import LLM, SamplingParams
    from quickdraft.engine import engine

    if not history:  # the plan starts from its neutral prior, as in a process whose cache holds no history
        engine.HISTORY_STEPS = 0

    llm = LLM(model, speculative_config=spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = (llm.generate([prompt], params) if isinstance(prompt, str) else llm.chat([prompt], params))[0]
    seconds = out.finish_time - out.first_token_time
    print(json.dumps({"tok_s": (len(out.token_ids) - 1) / seconds, "tokens": out.token_ids,
                      "drafted": out.spec.num_draft_tokens, "accepted": out.spec.num_accepted_tokens}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="the adaptive plan's largest K")
    p.add_argument("--fixed", type=int, nargs="+", default=[2, 3, 4], help="the fixed K values")
    p.add_argument("--humaneval", type=int, default=2, help="HumanEval prompts")
    p.add_argument("--mtbench", type=int, default=1, help="MT-Bench questions (first turns, chat template)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        job = json.loads(args.child)
        child(args.model, job["spec"], job["prompt"], args.max_tokens, job["history"])
        return 0
    from quickdraft.evaluation.datasets import humaneval, mtbench

    prompts = [x.prompt for x in humaneval(args.humaneval)]
    prompts += [[{"role": "user", "content": q.turns[0]}] for q in mtbench(args.mtbench)]
    base = {"method": "draft_model", "model": args.draft_model}
    # "adaptive": from the drafter's acceptance that earlier processes kept in the cache (the
    # adaptive runs before it here); "adaptive, no history": from the neutral prior
    variants = {"adaptive": dict(base, num_speculative_tokens=args.num_speculative_tokens)}
    variants["adaptive, no history"] = variants["adaptive"]
    variants.update({f"K={k}": dict(base, num_speculative_tokens=k, adaptive=False) for k in args.fixed})
    rates = {(i, v): [] for i in range(len(prompts)) for v in variants}
    ok = True
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            reference = None
            for name, spec in variants.items():
                out = subprocess.run([sys.executable, __file__, "--model", args.model, "--draft-model", args.draft_model,
                                      "--max-tokens", str(args.max_tokens),
                                      "--child", json.dumps({"spec": spec, "prompt": prompt,
                                                             "history": name != "adaptive, no history"})],
                                     capture_output=True, text=True, check=True)
                run = json.loads(out.stdout.strip().splitlines()[-1])
                reference = reference or run["tokens"]
                ok &= run["tokens"] == reference
                rates[i, name].append(run["tok_s"])
                print(f"round {r + 1}, prompt {i}: {name} {run['tok_s']:.2f} tok/s "
                      f"({run['accepted']}/{run['drafted']} drafts accepted)", flush=True)
    adaptive = [n for n in variants if n.startswith("adaptive")]
    ratios = {n: [] for n in adaptive}
    for i in range(len(prompts)):
        med = {name: statistics.median(rates[i, name]) for name in variants}
        best = max((n for n in variants if n not in adaptive), key=med.get)
        for n in adaptive:
            ratios[n].append(med[n] / med[best])
        print(f"prompt {i}: best fixed {best} {med[best]:.2f} tok/s; "
              + ", ".join(f"{n} {med[n]:.2f} ({med[n] / med[best]:.2f}x)" for n in adaptive), flush=True)
    for n in adaptive:
        print(f"{n} against the best fixed K, geometric mean over prompts: "
              f"{math.exp(statistics.fmean(math.log(x) for x in ratios[n])):.2f}x", flush=True)
    print("every output the same" if ok else "OUTPUTS DIFFER", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
