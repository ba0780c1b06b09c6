"""The server's resident memory (RSS) before and after hostile requests, kind by kind.

Starts ``quickdraft serve`` on 127.0.0.1 (a free port), answers two ordinary chat requests, reads
RSS, then sends each kind of hostile input below once (the warm-up round: first-use allocations),
then ``--repeat`` times each, reading RSS before and after every kind. Every hostile request must
be refused with a 400 or 413 in OpenAI's error format, and an ordinary request must succeed
after each kind. Prints one line a kind and
the totals; exits 1 where a status or the serving afterwards was not as expected.

    python examples/hostile_inputs.py smollm2-135m-instruct --repeat 7
    python examples/hostile_inputs.py smollm2-135m-instruct --kinds messages_20k,tools_5k -- --max-model-len 4096

Arguments after the model and this script's own flags go to ``quickdraft serve`` as they are.
docs/serving-errors.md gives the figures measured with it.
"""
import argparse, json, socket, subprocess, sys, tempfile, time

import httpx
import psutil

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("model", nargs="?", default="smollm2-135m-instruct")
p.add_argument("--repeat", type=int, default=7, help="requests of each kind after the warm-up round")
p.add_argument("--kinds", default="", help="comma-separated kinds to send (default: all)")
args, serve_flags = p.parse_known_args()
serve_flags = [f for f in serve_flags if f != "--"]
MODEL = args.model
C, CHAT = "/v1/completions", "/v1/chat/completions"


def _turns(n: int) -> list:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": "hello there"} for i in range(n)]


def _tools(n: int) -> list:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}} for i in range(n)]


HI = [{"role": "user", "content": "Hi"}]
KINDS = {  # name: (path, body); None: the raw-socket headers case
    "body5mb_prompt": (C, {"model": MODEL, "prompt": "x " * 2_500_000, "max_tokens": 1}),
    "body5mb_junk": (C, b"{" + b"a" * 5_000_000),
    "model_name_1mb": (C, {"model": "m" * 1_000_000, "prompt": "Hi"}),
    "messages_20k": (CHAT, {"model": MODEL, "messages": _turns(20_000), "max_tokens": 1}),
    "headers_64k": None,
    "stop_100k": (C, {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "stop": ["ab"] * 100_000}),
    "logit_bias_200k": (C, {"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                            "logit_bias": {str(i): 1 for i in range(200_000)}}),
    "prompt_ids_1m": (C, {"model": MODEL, "prompt": list(range(100)) * 10_000, "max_tokens": 1}),
    "prompts_10k": (C, {"model": MODEL, "prompt": ["Hi"] * 10_000, "max_tokens": 1}),
    "tools_5k": (CHAT, {"model": MODEL, "messages": HI, "max_tokens": 1, "tools": _tools(5000)}),
    "tokenize_5mb": ("/tokenize", {"model": MODEL, "prompt": "x " * 2_500_000}),
}
if args.kinds:
    KINDS = {k: KINDS[k] for k in args.kinds.split(",")}
BODIES = {k: (v if v is None or isinstance(v[1], bytes) else (v[0], json.dumps(v[1]).encode()))
          for k, v in KINDS.items()}

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
log = tempfile.NamedTemporaryFile(prefix="qd-hostile-", suffix=".log", delete=False)
proc = subprocess.Popen([sys.executable, "-m", "quickdraft", "serve", MODEL, "--host", "127.0.0.1", "--port",
                         str(port), "--no-access-log", "--log-level", "warning", *serve_flags],
                        stdout=log, stderr=subprocess.STDOUT)
url = f"http://127.0.0.1:{port}"
failures = []


def rss() -> float:
    return psutil.Process(proc.pid).memory_info().rss / 2**20


def serves(client: httpx.Client) -> bool:
    r = client.post(CHAT, json={"model": MODEL, "messages": HI, "max_tokens": 4})
    return r.status_code == 200


def headers_64k() -> tuple[int, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536
                  + b"\r\nContent-Length: 2\r\n\r\n{}")
        s.shutdown(socket.SHUT_WR)
        response = b""
        try:
            while chunk := s.recv(4096):
                response += chunk
        except OSError:
            pass
    head, _, body = response.partition(b"\r\n\r\n")
    words = head.split()
    status = int(words[1]) if len(words) > 1 and words[1].isdigit() else 0
    return status, body.decode(errors="replace")


def send(client: httpx.Client, name: str) -> tuple[int, str]:
    """(status, what the error says) for one hostile request; a failure recorded where it is not a
    400/413 in OpenAI's error format."""
    if BODIES[name] is None:
        status, text = headers_64k()
        ok = status == 400 and b'request_headers_too_large' in text.encode()
    else:
        path, body = BODIES[name]
        r = client.post(path, content=body)
        status, text = r.status_code, r.text[:160]
        try:
            error = r.json()["error"]
            ok = status in (400, 413) and {"message", "type", "param", "code"} <= set(error) and len(r.content) < 4096
        except (ValueError, KeyError, TypeError):
            ok = False
    if not ok:
        failures.append(f"{name}: {status} {text}")
    return status, text


try:
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the server did not start; its log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    with httpx.Client(base_url=url, timeout=120, headers={"Content-Type": "application/json"}) as client:
        serves(client), serves(client)
        time.sleep(1)
        start = rss()
        print(f"RSS after two ordinary requests: {start:.1f} MiB")
        for name in KINDS:  # the warm-up round
            b = rss()
            status, text = send(client, name)
            print(f"warm-up {name:16s} {status}  {b:7.1f} -> {rss():7.1f} MiB  {text[:90]!r}")
        serves(client)
        time.sleep(1)
        warm = rss()
        print(f"RSS after the warm-up round: {warm:.1f} MiB ({warm - start:+.1f})")
        for name in KINDS:
            b, t = rss(), time.monotonic()
            for _ in range(args.repeat):
                send(client, name)
            if not serves(client):
                failures.append(f"{name}: an ordinary request failed afterwards")
            time.sleep(1)
            a = rss()
            print(f"{name:16s} x{args.repeat}: {b:7.1f} -> {a:7.1f} MiB ({a - b:+6.1f})  {time.monotonic() - t:.1f} s")
        end = rss()
        print(f"RSS {start:.1f} -> {end:.1f} MiB ({end - start:+.1f}) from before the hostile requests, "
              f"{warm:.1f} -> {end:.1f} ({end - warm:+.1f}) from after the warm-up round; "
              f"still serving: {serves(client)}")
finally:
    proc.terminate()
    proc.wait(30)
for f in dict.fromkeys(failures):  # once each
    print("FAILED", f[:200])
sys.exit(1 if failures else 0)
