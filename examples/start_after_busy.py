"""Whether a server's speed depends on what ran before it started: ``quickdraft serve`` started on an
idle machine, against the same server started a minute after two CPU-bound processes ended (the
1-minute load average still high, the cores free again), by turns.

Each round: wait until the 1-minute load average is below ``--idle-load``, start a server on the
idle machine, time its requests, stop it; run two busy loops for ``--busy`` seconds, stop them,
wait ``--wait`` seconds, start a server, time the same requests, stop it. The requests are
HumanEval prompts sent one at a time to ``/v1/completions`` (greedy, ``--max-tokens`` each, after
one warm-up request); tokens/s is all their tokens over their wall time.
Prints each server's load average at its start, its tokens/s, and the median ratio of the
after-busy server to the idle one.

    python examples/start_after_busy.py --model qwen2.5-coder-1.5b-instruct \\
        --speculative-config '{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}'
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def serve_and_time(args, prompts: list[str]) -> tuple[float, float, list[str]]:
    """A fresh server: the load average at its start, its tokens/s over the prompts, the texts."""
    from quickdraft.bench.llama_server import free_port

    load = os.getloadavg()[0]
    port = free_port()
    cmd = [sys.executable, "-m", "quickdraft", "serve", args.model, "--port", str(port)]
    if args.speculative_config:
        cmd += ["--speculative-config", args.speculative_config]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with code {proc.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not come up in 900 s")
            time.sleep(0.5)
        body = {"model": args.model, "temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": True}
        post(url + "/v1/completions", dict(body, prompt=prompts[0], max_tokens=8))  # warm-up
        tokens, started, texts = 0, time.perf_counter(), []
        for prompt in prompts:
            out = post(url + "/v1/completions", dict(body, prompt=prompt))
            tokens += out["usage"]["completion_tokens"]
            texts.append(out["choices"][0]["text"])
        return load, tokens / (time.perf_counter() - started), texts
    finally:
        proc.terminate()
        proc.wait()


def busy(seconds: float, processes: int = 2) -> None:
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    time.sleep(seconds)
    for p in loops:
        p.kill()
        p.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--speculative-config", default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--busy", type=float, default=60.0, help="seconds the two busy loops run")
    p.add_argument("--wait", type=float, default=60.0, help="seconds between their end and the server's start")
    p.add_argument("--idle-load", type=float, default=0.5, help="the load average an idle start waits for")
    args = p.parse_args()
    from quickdraft.evaluation.datasets import humaneval

    prompts = [x.prompt for x in humaneval(args.prompts)]
    ratios, reference, ok = [], None, True
    for r in range(args.rounds):
        deadline = time.monotonic() + 600
        while os.getloadavg()[0] >= args.idle_load and time.monotonic() < deadline:
            time.sleep(5)
        idle_load, idle, texts = serve_and_time(args, prompts)
        reference = reference or texts
        ok &= texts == reference
        print(f"round {r + 1}: idle start (load {idle_load:.2f}): {idle:.2f} tok/s", flush=True)
        busy(args.busy)
        time.sleep(args.wait)
        after_load, after, texts = serve_and_time(args, prompts)
        ok &= texts == reference
        ratios.append(after / idle)
        print(f"round {r + 1}: started {args.wait:.0f} s after two busy processes ended (load {after_load:.2f}): "
              f"{after:.2f} tok/s, {ratios[-1]:.2f}x the idle start", flush=True)
    print(f"median {statistics.median(ratios):.2f}x over {len(ratios)} rounds; "
          f"{'every output the same' if ok else 'OUTPUTS DIFFER'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
