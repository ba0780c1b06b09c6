"""Throughput of quickdraft behind Ray Serve's proxy: 2 replicas of 1 CPU each against 1 replica of
2 CPUs (the same machine, split two ways) and 1 replica of 1 CPU (half of it), SmolLM2-135M-Instruct
(bfloat16, its GGUF blocks as stored), greedy, no speculation, 8 concurrent streams of 48 tokens
through the openai client. One local Ray cluster; each configuration is deployed in turn (the
configurations interleaved over the rounds, a warm-up after each deployment), medians over rounds.
Prints README rows.

    python examples/ray_replicas.py [--rounds 3]
"""
import argparse, concurrent.futures as cf, os, statistics, sys, time

import openai

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
import ray
from ray import serve

from quickdraft.server.cli import serve_parser
from quickdraft.deploy.ray_serve import APP_NAME, build_application

MODEL, PORT, STREAMS, REQUESTS, TOKENS = "smollm2-135m-instruct", 8790, 8, 32, 48
CONFIGS = {"1 replica x 1 CPU": ("1", "1"), "1 replica x 2 CPUs": ("1", "2"), "2 replicas x 1 CPU": ("2", "1")}
PROMPTS = [f"Write a short story about a {w} (number {i})." for i in range(8)
           for w in ("cat", "robot", "lighthouse", "dragon")]

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=3)
rounds = p.parse_args().rounds
ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": PORT})
client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=300)


def one(i):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                       max_completion_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True})
    return r.usage.completion_tokens


res = {c: [] for c in CONFIGS}
for rnd in range(rounds):
    for name, (replicas, cpus) in CONFIGS.items():
        args = serve_parser().parse_args(["--ray", "--model", MODEL, "--num-replicas", replicas,
                                          "--replica-cpus", cpus, "--max-num-seqs", "8"])
        serve.run(build_application(args), name=APP_NAME, route_prefix="/")
        with cf.ThreadPoolExecutor(STREAMS) as pool:
            list(pool.map(one, range(STREAMS)))  # warm-up: every replica's first passes
            t = time.perf_counter()
            tokens = sum(pool.map(one, range(REQUESTS)))
            dt = time.perf_counter() - t
        res[name].append(tokens / dt)
        print(f"round {rnd}: {name}: {tokens} tokens in {dt:.1f}s = {tokens / dt:.1f} tok/s", file=sys.stderr, flush=True)
        serve.delete(APP_NAME)

base = statistics.median(res["1 replica x 2 CPUs"])
print("| replicas x CPUs | tok/s (median) | rounds | vs 1 replica x 2 CPUs |")
print("|---|---:|---|---:|")
for name, xs in res.items():
    print(f"| {name} | {statistics.median(xs):.1f} | {', '.join(f'{x:.1f}' for x in xs)} | "
          f"{statistics.median(xs) / base:.2f}x |")
serve.shutdown()
ray.shutdown()
