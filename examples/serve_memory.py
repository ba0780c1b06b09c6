"""Peak resident memory of ``quickdraft serve`` with every KV slot in use: what a Kubernetes pod's
memory request must hold (deploy/k8s/deployment.yaml). Starts the server with the given flags,
sends --max-num-seqs concurrent requests at once, and reads the process's VmHWM (peak RSS) and
VmRSS from /proc when they are done.

    python examples/serve_memory.py --model qwen2.5-coder-1.5b-instruct --max-num-seqs 8 --max-model-len 4096 \\
        --speculative-config '{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}'
"""
import argparse, concurrent.futures as cf, socket, subprocess, sys, time

import httpx
import openai

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--max-num-seqs", type=int, default=8)
p.add_argument("--max-tokens", type=int, default=64)
args, serve_flags = p.parse_known_args()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
cmd = [sys.executable, "-m", "quickdraft", "serve", "--model", args.model, "--max-num-seqs", str(args.max_num_seqs),
       "--port", str(port), "--no-access-log", "--log-level", "warning", *serve_flags]
proc = subprocess.Popen(cmd)
try:
    url = f"http://127.0.0.1:{port}"
    while True:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)

    def status() -> dict:
        fields = dict(line.split(":", 1) for line in open(f"/proc/{proc.pid}/status"))
        return {k: int(fields[k].split()[0]) / 2**20 for k in ("VmHWM", "VmRSS")}  # kB -> GiB

    idle = status()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    ask = lambda i: client.chat.completions.create(  # noqa: E731
        model=args.model, messages=[{"role": "user", "content": f"Write a Python function number {i} that sorts a list."}],
        max_completion_tokens=args.max_tokens, temperature=0, extra_body={"ignore_eos": True}).usage.completion_tokens
    with cf.ThreadPoolExecutor(args.max_num_seqs) as pool:
        tokens = sum(pool.map(ask, range(args.max_num_seqs)))
    busy = status()
    print(f"{' '.join(cmd[3:])}\nidle: peak {idle['VmHWM']:.2f} GiB, resident {idle['VmRSS']:.2f} GiB; after "
          f"{args.max_num_seqs} concurrent requests ({tokens} tokens): peak {busy['VmHWM']:.2f} GiB, "
          f"resident {busy['VmRSS']:.2f} GiB")
finally:
    proc.terminate()
    proc.wait(60)
