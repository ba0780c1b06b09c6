"""Does ``quickdraft advise`` say what serving delivers? One run: ``advise`` on your prompts, then a
``quickdraft serve`` process for plain decoding and one for each drafter advise measured, asked the
same prompts through the ``openai`` client, one request at a time, servers taking turns prompt by
prompt (rotating who goes first) so that a machine whose speed drifts falls on all alike. Prints
advise's speedup at batch 1 beside the served one (median over prompts of each drafter's tokens per
second over plain's on the same prompt), and whether the drafter advise chose is the one that served
fastest (or how far behind the fastest it served). Exits 1 where a served output differs from plain's.

    python examples/advise_vs_served.py qwen2.5-coder-1.5b-instruct humaneval \\
        --draft-model qwen2.5-coder-0.5b-instruct --methods suffix --num-prompts 8 --max-tokens 128
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, spec: dict | None, max_model_len: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "quickdraft", "serve", model, "--port", str(port), "--max-num-seqs", "1",
           "--max-model-len", str(max_model_len)]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}/v1"


def wait_ready(proc: subprocess.Popen, base: str, log: Path, timeout: float = 600.0) -> None:
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a server exited ({proc.returncode}); its log: {log}\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1.0)
    raise SystemExit(f"a server did not answer in {timeout:.0f} s; its log: {log}")


def ask(client, model: str, row, max_tokens: int) -> tuple[list[int] | str, float]:
    """One request as advise asks it (a raw prompt, or a chat's first turn), greedy: (its text,
    tokens per second over the whole request, as advise counts a wave)."""
    started = time.perf_counter()
    if row.prompt is not None:
        out = client.completions.create(model=model, prompt=row.prompt, max_tokens=max_tokens, temperature=0)
        text = out.choices[0].text
    else:
        messages = list(row.messages) + [{"role": "user", "content": row.turns[0]}]
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
        text = out.choices[0].message.content
    return text, out.usage.completion_tokens / (time.perf_counter() - started)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("prompts", help="as advise takes them: a JSONL, humaneval or mtbench")
    p.add_argument("--draft-model", action="append", default=[])
    p.add_argument("--methods", default="ngram,suffix")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    # once by default, as advise asks them: suffix keeps what it served in its trie, so a prompt
    # asked again is drafted from its own earlier answer (1.80x served against 1.13x, MT-Bench)
    p.add_argument("--rounds", type=int, default=1, help="times each server is asked each prompt")
    p.add_argument("--work-dir", default=None, help="where advise's report and the servers' logs go")
    args = p.parse_args()

    from openai import OpenAI

    from quickdraft.commands.advise import WARMUP_PROMPTS, WARMUP_TOKENS
    from quickdraft.evaluation.datasets import load

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="advise-vs-served-"))
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "quickdraft", "advise", args.model, args.prompts, "--methods", args.methods,
           "--batch-size", "1", "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
           "--max-model-len", str(args.max_model_len), "--result-dir", str(work / "advise"), "--no-progress"]
    for d in args.draft_model:
        cmd += ["--draft-model", d]
    print("$", " ".join(cmd[1:]), flush=True)
    started = time.time()
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    advised = json.loads((work / "advise" / "results.json").read_text())
    print(f"advise took {time.time() - started:.0f} s; verdict: {advised['verdict']['drafter'] or 'plain decoding'}",
          flush=True)

    variants = [("none", None)] + [(d["name"], d["spec"]) for d in advised["drafters"]]
    servers = {}
    try:
        for name, spec in variants:  # one at a time: each calibrates its passes on a quiet machine
            log = work / f"serve-{len(servers)}.log"
            proc, base = start(args.model, spec, args.max_model_len, log)
            servers[name] = (proc, OpenAI(base_url=base, api_key="-", max_retries=0, timeout=600))
            wait_ready(proc, base, log)
        for name, (_, client) in servers.items():  # as advise warms each engine before it measures
            for text in WARMUP_PROMPTS:
                client.completions.create(model=args.model, prompt=text, max_tokens=WARMUP_TOKENS, temperature=0)
        rows = load(args.prompts, args.num_prompts or None)
        names = list(servers)
        rates = {n: [[] for _ in rows] for n in names}
        texts = {n: [None] * len(rows) for n in names}
        turn = 0
        for _ in range(args.rounds):
            for i, row in enumerate(rows):
                order = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for n in order:
                    text, rate = ask(servers[n][1], args.model, row, args.max_tokens)
                    rates[n][i].append(rate)
                    texts[n][i] = text
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(timeout=60)

    ok = True
    plain = [statistics.median(r) for r in rates["none"]]
    print(f"\n{len(rows)} prompts x {args.rounds} rounds, {args.max_tokens} tokens, greedy, one request at a time")
    print(f"{'drafter':<40} {'advise (batch 1)':>16} {'served':>8} {'served tok/s':>13}  outputs")
    print(f"{'none':<40} {'1.00x':>16} {'1.00x':>8} {statistics.median(plain):>13.2f}")
    served = {}
    for d in advised["drafters"]:
        n = d["name"]
        mine = [statistics.median(r) for r in rates[n]]
        served[n] = statistics.median(m / b for m, b in zip(mine, plain))
        same = texts[n] == texts["none"]
        ok &= same
        print(f"{n:<40} {d['speedup']['1']:>15.2f}x {served[n]:>7.2f}x {statistics.median(mine):>13.2f}  "
              f"{'identical' if same else 'DIFFER'}")
    chosen = advised["verdict"]["drafter"]
    served["none"] = 1.0
    best = max(served, key=served.get)
    pick = chosen or "none"
    print(f"\nadvise chose: {chosen or 'plain decoding'}, served at {served[pick]:.2f}x; served fastest: "
          f"{best if best != 'none' else 'plain decoding'}, {served[best]:.2f}x"
          + (" -> the same" if pick == best else f" -> advise's choice served at {served[pick] / served[best]:.0%} of it"))
    print(f"advise's report: {work / 'advise' / 'report.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
