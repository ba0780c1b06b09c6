"""Time to first token of chat turns, with and without prefix caching, through the server.

    python -m quickdraft.bench.turns --model smollm2-135m-instruct --num-prompts 16 --max-tokens 64 \\
        --result-dir bench-out/turns

Two ``quickdraft serve`` processes are started side by side on loopback, one with
``--enable-prefix-caching`` and one with ``--no-enable-prefix-caching`` (the same model and flags
otherwise). Each MT-Bench question is asked on both, in alternating order: its first turn, then its
second turn with the first answer in the history, one request at a time, greedy and streamed. The
second turn's prompt is the first turn's conversation plus a few tokens: with the cache it is
mostly reused. Measured at the client: TTFT (request sent -> first token chunk), and from the usage,
the prompt's tokens and those served from the cache. Greedy answers are compared between the two
servers (they must be equal). Medians of each turn; a shared machine makes single figures noisy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from quickdraft.bench.loadgen import percentile, start_server


def chat(client: httpx.Client, url: str, body: dict) -> dict:
    """One streamed chat completion: its text, TTFT and usage."""
    t0 = time.perf_counter()
    first, parts, usage = None, [], {}
    with client.stream("POST", url + "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for c in ev.get("choices", []):
                text = (c.get("delta") or {}).get("content")
                if text:
                    first = first or time.perf_counter()
                    parts.append(text)
    return {"text": "".join(parts), "ttft": (first or time.perf_counter()) - t0,
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def two_turns(client: httpx.Client, url: str, model: str, question, max_tokens: int) -> list[dict]:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    messages = [*question.messages, {"role": "user", "content": question.turns[0]}]
    first = chat(client, url, {**body, "messages": messages})
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": question.turns[1]}]
    return [first, chat(client, url, {**body, "messages": messages})]


def summary(rows: list[dict]) -> dict:
    out = {}
    for label in dict.fromkeys(r["server"] for r in rows):
        for turn in (1, 2):
            mine = [r for r in rows if r["server"] == label and r["turn"] == turn]
            out[f"{label} turn {turn}"] = {
                "requests": len(mine), "ttft_p50": percentile([r["ttft"] for r in mine], 0.5),
                "ttft_p90": percentile([r["ttft"] for r in mine], 0.9),
                "prompt_tokens_p50": percentile([r["prompt_tokens"] for r in mine], 0.5),
                "cached_share": sum(r["cached_tokens"] for r in mine) / max(1, sum(r["prompt_tokens"] for r in mine)),
            }
    return out


def table(s: dict) -> str:
    lines = ["| server, turn | requests | prompt tokens p50 | served from cache | TTFT p50 (s) | TTFT p90 (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in s.items():
        lines.append(f"| {name} | {r['requests']} | {r['prompt_tokens_p50']:.0f} | {r['cached_share']:.0%} | "
                     f"{r['ttft_p50']:.3f} | {r['ttft_p90']:.3f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    from quickdraft.arguments import HelpFormatter, add_dtype_arg, add_flag

    p = argparse.ArgumentParser(prog="python -m quickdraft.bench.turns", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    add_dtype_arg(p)
    p.add_argument("--max-model-len", type=int, default=2048)
    add_flag(p, "--num-prompts", type=int, default=16, deprecated=("--limit",),
             help="MT-Bench questions (round-robin over its categories)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--serve-arg", action="append", default=[], help="extra argument for both servers")
    add_flag(p, "--result-dir", default=None, deprecated=("--out",), help="a directory for results.json and table.md")
    return p


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from quickdraft.evaluation import datasets

    args = parser().parse_args(argv)
    questions = [q for q in datasets.load("mtbench", args.num_prompts) if len(q.turns) >= 2]
    servers = {}
    try:
        for label, flag in (("prefix cache on", "--enable-prefix-caching"), ("prefix cache off", "--no-enable-prefix-caching")):
            ns = SimpleNamespace(model=args.model, dtype=args.dtype, concurrency=[1], max_model_len=args.max_model_len,
                                 serve_arg=[*args.serve_arg, flag])
            servers[label] = start_server(ns, "none")
        rows, mismatches = [], 0
        with httpx.Client(timeout=None) as client:
            model = httpx.get(next(iter(servers.values()))[1] + "/v1/models").json()["data"][0]["id"]
            for _, url in servers.values():  # warm up: kernels, allocator
                two_turns(client, url, model, questions[0], 8)
            for i, q in enumerate(tqdm(questions, desc="turns", unit="question", dynamic_ncols=True)):
                order = list(servers.items()) if i % 2 == 0 else list(servers.items())[::-1]
                answers = {}
                for label, (_, url) in order:
                    turns = two_turns(client, url, model, q, args.max_tokens)
                    answers[label] = [t["text"] for t in turns]
                    rows += [{"server": label, "question": q.id, "turn": j + 1, **t} for j, t in enumerate(turns)]
                mismatches += len({json.dumps(a) for a in answers.values()}) > 1
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    s = summary(rows)
    text = table(s) + f"\n\nquestions whose greedy answers differ between the two servers: {mismatches}"
    print(text)
    if args.result_dir:
        out = Path(args.result_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"args": vars(args), "summary": s, "rows": rows,
                                                      "mismatches": mismatches}, indent=2))
        (out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
