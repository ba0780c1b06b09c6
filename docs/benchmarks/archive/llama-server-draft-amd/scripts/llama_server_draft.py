"""llama-server with the 0.5B draft (-md) against its own plain decoding, one server at a time, the
same three HumanEval prompts, 128 tokens, greedy: K = 1, 2, 4 and ggml's polling on or off.

    python llama_server_draft.py plain md md_poll0 md_polldraft0   # the first run (2 rounds)
    python llama_server_draft.py --rounds 1 plain md_k1 md_k2        # the second
"""
import argparse
import json
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from quickdraft.evaluation.datasets import humaneval

CACHE = Path.home() / ".cache" / "quickdraft"
BIN = CACHE / "llama-server" / "native" / "bin" / "llama-server"
TARGET = CACHE / "models" / "qwen2.5-coder-1.5b-instruct.gguf"
DRAFT = CACHE / "models" / "qwen2.5-coder-0.5b-instruct.gguf"
BASE = [str(BIN), "-m", str(TARGET), "--host", "127.0.0.1", "-c", "2048", "-np", "1", "-t", "2", "-tb", "2", "-ngl", "0"]


def md(k: int) -> list[str]:
    return ["-td", "2", "-tbd", "2", "-md", str(DRAFT), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
            "--spec-draft-n-min", "0", "-ngld", "0"]


VARIANTS = {"plain": [], "md": md(4), "md_poll0": md(4) + ["--poll", "0", "--poll-draft", "0"],
            "md_polldraft0": md(4) + ["--poll-draft", "0"], "md_k1": md(1), "md_k2": md(2)}


def request(port: int, prompt: str, n: int) -> dict:
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False}).encode()
    r = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                               headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(r, timeout=600).read())


def run(name: str, port: int, prompts: list[str]) -> list[tuple]:
    proc = subprocess.Popen(BASE + VARIANTS[name] + ["--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        request(port, "def f(x):", 16)  # warm
        out = []
        for prompt in prompts:
            started = time.perf_counter()
            t = request(port, prompt, 128)["timings"]
            out.append((t["predicted_n"] / (time.perf_counter() - started), t["predicted_per_second"],
                        t.get("draft_n"), t.get("draft_n_accepted")))
        return out
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    prompts = [row.prompt for row in humaneval(3)]
    results = {v: [] for v in args.variants}
    port = 39100
    for rnd in range(args.rounds):
        for v in args.variants:
            port += 1
            out = run(v, port, prompts)
            results[v] += out
            print(rnd, v, [f"{a:.1f}/{b:.1f} drafted {c} accepted {d}" for a, b, c, d in out], flush=True)
    for v, out in results.items():
        print(f"{v}: median tok/s over the request {statistics.median(a for a, *_ in out):.2f}, "
              f"decoding {statistics.median(b for _, b, *_ in out):.2f}")


if __name__ == "__main__":
    main()
