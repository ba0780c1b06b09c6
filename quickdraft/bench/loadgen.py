"""The serving speed table: output tokens/s, time to first token and time per output token
(p50, p99) at 1, 4 and 8 concurrent streams, with and without speculation, in one run.

    python -m quickdraft.bench.loadgen --model qwen2.5-coder-1.5b-instruct \\
        --speculative-config none --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \\
        --speculative-config '{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct"}' \\
        --concurrency 1 4 8 --max-tokens 128 --result-dir bench-out/serve

Each configuration gets its own ``quickdraft serve`` process (started here, on a free loopback
port), is warmed up, then runs ``--requests-per-stream`` requests per stream at each concurrency:
each stream sends its next request as soon as its last one ended. Greedy, streaming, with
``stream_options.include_usage``. Measured at the client:

* TTFT: request sent -> first chunk with a token;
* TPOT: (last token chunk - first token chunk) / (completion tokens - 1), per request;
* tokens/s: all completion tokens of a concurrency level / its wall time.

Speculation is left on at every batch size here (``--speculative-disable-by-batch-size 0``
unless ``--serve-arg`` says otherwise), since the point is to see where it stops paying.
Run it under ``flock /tmp/qd.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def load_prompts(dataset: str, limit: int) -> list[dict]:
    """Request bodies (without model / max_tokens): HumanEval as completions, MT-Bench as chats."""
    from quickdraft.evaluation import datasets

    rows = datasets.load(dataset, limit)
    out = []
    for p in rows:
        if p.prompt is not None:
            out.append({"prompt": p.prompt})
        else:
            out.append({"messages": [*p.messages, {"role": "user", "content": p.turns[0]}]})
    return out


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    t0 = time.perf_counter()
    first = last = None
    usage = None
    async with client.stream("POST", url + path, json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices", []):
                if c.get("text") or (c.get("delta") or {}).get("content") or c.get("token_ids"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
    n = usage["completion_tokens"]
    return {"ttft": (first or time.perf_counter()) - t0,
            "tpot": (last - first) / (n - 1) if first and n > 1 else None,
            "tokens": n, "spec": usage.get("speculative", {})}


async def run_level(url: str, model: str, prompts: list[dict], concurrency: int, per_stream: int,
                    max_tokens: int, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    todo = [prompts[i % len(prompts)] for i in range(concurrency * per_stream)]
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=None, headers=headers, limits=limits) as client:
        async def stream():
            while todo:
                body = todo.pop(0)
                results.append(await one_request(client, url, {"model": model, "max_tokens": max_tokens,
                                                               "temperature": 0, "return_token_ids": True, **body}))
        t0 = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    drafts = sum(r["spec"].get("num_draft_tokens", 0) for r in results)
    accepted = sum(r["spec"].get("num_accepted_tokens", 0) for r in results)
    passes = sum(r["spec"].get("num_target_passes", 0) for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "tpot_p50": percentile(tpot, 0.5), "tpot_p99": percentile(tpot, 0.99),
            "acceptance_rate": accepted / drafts if drafts else 0.0,
            "tokens_per_pass": tokens / passes if passes else 0.0}


def start_server(args, config: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "quickdraft", "serve", "--model", args.model, "--dtype", args.dtype,
           "--port", str(port), "--max-num-seqs", str(max(args.concurrency)), "--no-access-log",
           "--log-level", "warning", "--speculative-disable-by-batch-size", "0"]
    if config != "none":
        cmd += ["--speculative-config", config]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    cmd += args.serve_arg
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server for {config} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server for {config} did not come up")


def label(config: str) -> str:
    if config == "none":
        return "plain"
    c = json.loads(config)
    return c["method"] + (f" ({c['model']})" if c.get("model") else "") + f" K={c.get('num_speculative_tokens', 4)}"


def table(rows: list[dict]) -> str:
    head = ("| config | streams | tok/s | vs plain | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | TPOT p99 (ms) "
            "| accept | tok/pass |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    plain = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["config"] == "plain"}
    lines = [head]
    for r in rows:
        base = plain.get(r["concurrency"])
        vs = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['config']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {vs} | {r['ttft_p50']:.2f} | "
                     f"{r['ttft_p99']:.2f} | {1000 * r['tpot_p50']:.0f} | {1000 * r['tpot_p99']:.0f} | "
                     f"{r['acceptance_rate']:.0%} | {r['tokens_per_pass']:.2f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    from quickdraft.arguments import HelpFormatter, add_dtype_arg, add_flag

    p = argparse.ArgumentParser(prog="python -m quickdraft.bench.loadgen", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    add_dtype_arg(p)
    p.add_argument("--max-model-len", type=int, default=2048)
    add_flag(p, "--speculative-config", action="append", default=None, deprecated=("--config",),
             help='"none" or a speculative config\'s JSON, one server each (repeatable; default: none and ngram K=4)')
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests-per-stream", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dataset", default="humaneval", help="humaneval (completions) or mtbench (chat, turn 1)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--url", default=None, help="measure a running server instead (one config)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--serve-arg", action="append", default=[], help="extra argument for quickdraft serve")
    add_flag(p, "--result-dir", default=None, deprecated=("--out",), help="a directory for results.json and table.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configs = args.speculative_config or ["none", '{"method": "ngram", "num_speculative_tokens": 4}']
    prompts = load_prompts(args.dataset, args.num_prompts)
    rows = []
    for config in ([None] if args.url else configs):
        proc, url = (None, args.url) if args.url else start_server(args, config)
        try:
            model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {args.api_key}"}
                              if args.api_key else {}).json()["data"][0]["id"]
            asyncio.run(run_level(url, model, prompts, 2, 1, 16, args.api_key))  # warm up
            for c in args.concurrency:
                r = asyncio.run(run_level(url, model, prompts, c, args.requests_per_stream, args.max_tokens,
                                          args.api_key))
                r["config"] = label(config) if config else "server"
                rows.append(r)
                print(f"{r['config']:>28} c={c}: {r['tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50']:.2f}s, "
                      f"TPOT p50 {1000 * r['tpot_p50']:.0f} ms", file=sys.stderr)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    text = table(rows)
    print(text)
    if args.result_dir:
        out = Path(args.result_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        (out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
