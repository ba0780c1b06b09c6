"""Throughput at a concurrency, plain decoding against a speculative configuration: the same
HumanEval prompts, max_num_seqs requests at a time (the engine's continuous batching), pairs
interleaved (plain, speculative, plain, ...) so that a machine whose speed drifts falls on both alike,
each run in a fresh process (the adaptive plan starts cold in each). Prints each run and the median
of the pairs' ratios; checks that every speculative output equals its plain one.

    python examples/concurrency.py --model qwen2.5-coder-1.5b-instruct --concurrency 1 2 4 8 \\
        --speculative-config '{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}'

With ``--llama-server``, llama.cpp's own server takes its turn in each round as well, on the same
prompt token ids and GGUF files: plain and with the same draft file (``-md``, the same K), both
with ``-np N`` slots (its continuous batching) for concurrency N, the requests sent N at a time.
Its tokens/s is taken as quickdraft's is, all the tokens of the round over its wall time, prompts
included. The binary is the bench's (``make llama-server``; ``QUICKDRAFT_ISA=avx2`` picks the AVX2
build, and the same variable forces quickdraft's kernels to that path).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


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
                      "prompts": [o.prompt_token_ids for o in outs],
                      "draft_tokens": sum(o.spec.num_draft_tokens for o in outs),
                      "switch": switch.to_dict() if switch else None}))


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two outputs share from their start (the two engines round differently, and
    a greedy choice between near-equal logits can go either way)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def gguf(name: str) -> str | None:
    """The GGUF file of a built-in model or a path, or None (llama-server reads GGUF only)."""
    from quickdraft.models.registry import is_builtin, model_path

    if is_builtin(name):
        return str(model_path(name))
    return name if name.endswith(".gguf") and os.path.isfile(name) else None


class LlamaServers:
    """llama-server plain and with the draft file, ``-np concurrency`` slots each, started once for
    a concurrency and asked by turns with quickdraft's runs."""

    def __init__(self, model: str, spec: dict, concurrency: int, max_tokens: int):
        from quickdraft.bench import llama_server as ls
        from quickdraft.engine.threads import usable_cpus

        exe = ls.binary()
        if exe is None:
            raise SystemExit(f"no llama-server: build it with `make llama-server`, or set ${ls.BINARY_ENV}")
        target = gguf(model)
        if target is None:
            raise SystemExit(f"--llama-server needs a GGUF target; {model} is not one")
        draft = gguf(spec["model"]) if spec.get("method") == "draft_model" and spec.get("model") else None
        k = int(spec.get("num_speculative_tokens", 4))
        self.ls, self.concurrency, self.max_tokens = ls, concurrency, max_tokens
        self.servers = {}
        threads = usable_cpus()  # the count quickdraft's engine starts with where it is not set
        for mode in ls.modes(draft, k, 4)[: 2 if draft else 1]:  # plain, and -md where the draft is a GGUF file
            port = ls.free_port()
            server = ls.Server(ls.command(exe, target, mode, threads, 4096, port, slots=concurrency), port, mode.method)
            self.servers[mode.method] = server
            server.wait_ready()
            server.post("/completion", ls.request_body([1, 2, 3], 4, True))  # warm

    def run(self, method: str, prompts: list[list[int]]) -> dict:
        server = self.servers[method]

        def one(ids):
            return self.ls.parse_response(server.post("/completion", self.ls.request_body(ids, self.max_tokens, True)),
                                          set(), self.max_tokens, 0.0)

        started = time.perf_counter()
        with ThreadPoolExecutor(self.concurrency) as pool:
            outs = list(pool.map(one, prompts))
        seconds = time.perf_counter() - started
        return {"tok_s": sum(o["num_tokens"] for o in outs) / seconds, "outputs": [o["token_ids"] for o in outs],
                "draft_tokens": sum(o["num_draft_tokens"] for o in outs),
                "accepted": sum(o["num_accepted_tokens"] for o in outs)}

    def close(self) -> None:
        for s in self.servers.values():
            s.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--speculative-config", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--llama-server", action="store_true", help="llama.cpp's server, -np N, takes its turn too")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.model, args.speculative_config or None, args.concurrency[0], args.prompts, args.max_tokens)
        return 0
    ok = True
    for c in args.concurrency:
        llama = LlamaServers(args.model, json.loads(args.speculative_config), c, args.max_tokens) if args.llama_server else None
        rates: dict[str, list[float]] = {}
        ratios = []
        try:
            for _ in range(args.pairs):
                runs = []
                for spec in ("", args.speculative_config):
                    out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model,
                                          "--speculative-config", spec, "--concurrency", str(c), "--prompts",
                                          str(args.prompts), "--max-tokens", str(args.max_tokens)],
                                         capture_output=True, text=True, check=True)
                    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                plain, spec = runs
                same = plain["outputs"] == spec["outputs"]
                ok &= same
                ratios.append(spec["tok_s"] / plain["tok_s"])
                rates.setdefault("quickdraft plain", []).append(plain["tok_s"])
                rates.setdefault("quickdraft speculative", []).append(spec["tok_s"])
                line = (f"concurrency {c}: plain {plain['tok_s']:.2f} tok/s, speculative {spec['tok_s']:.2f} tok/s "
                        f"({ratios[-1]:.2f}x, {spec['draft_tokens']} draft tokens){'' if same else ', OUTPUTS DIFFER'}")
                for method in (llama.servers if llama else ()):
                    r = llama.run(method, plain["prompts"])
                    rates.setdefault(f"llama.cpp {method}", []).append(r["tok_s"])
                    agree = sum(a == b for a, b in zip(r["outputs"], plain["outputs"]))
                    shared = statistics.median(common_prefix(a, b) for a, b in zip(r["outputs"], plain["outputs"]))
                    line += (f"; llama.cpp -np {c} {method} {r['tok_s']:.2f} tok/s"
                             + (f" ({r['accepted']}/{r['draft_tokens']} drafts accepted)" if r["draft_tokens"] else "")
                             + f", {agree}/{len(r['outputs'])} outputs as quickdraft's (median {shared:g} tokens alike)")
                print(line, flush=True)
        finally:
            if llama:
                llama.close()
        print(f"concurrency {c}: median {statistics.median(ratios):.2f}x over {len(ratios)} pairs", flush=True)
        if llama:
            med = {name: statistics.median(v) for name, v in rates.items()}
            ours = max(v for n, v in med.items() if n.startswith("quickdraft"))
            theirs = max(v for n, v in med.items() if n.startswith("llama.cpp"))
            print(f"concurrency {c}: medians " + ", ".join(f"{n} {v:.2f}" for n, v in med.items())
                  + f" tok/s; quickdraft's best / llama.cpp's best {ours / theirs:.2f}x", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
