"""The soak: a real server under load, clients that go away, and hostile input, for a while.

    python -m quickdraft.bench.soak --duration 1800 --out soak.json

starts ``quickdraft serve`` (SmolLM2-135M-Instruct in float32, ngram K=4 by default) on a free
loopback port, or targets a running one (``--url``, with ``--pid`` for its memory), and for
``--duration`` seconds runs, all at once:

* *load*: ``--concurrency`` clients (the real ``openai`` client), each sending its next request as
  soon as its last ended: chat and completions, streamed and not, greedy and seeded sampling,
  with and without logprobs, under per-request speculation caps (``"speculative":
  {"num_speculative_tokens": k}``, k in 0..4, or the server's own);
* *disconnects*: a client that reads a few chunks of a stream and closes it, or gives up on a
  non-streaming request while it waits;
* *hostile input*: the requests the server's tests send (``HOSTILE``: bodies nested 10,000 deep,
  lone surrogates, prompts far past the context, ``max_tokens`` of 10^12 and 2^70, bodies over
  the size limit, malformed JSON, bad parameters, unknown models and routes), each checked for its
  status and OpenAI's error format.

A *failure* is any 5xx, dropped connection, timeout, error event in a stream, a hostile request
answered otherwise than expected, or a load request refused with anything but a 429 (queue full).
Before and after, it checks ``/health`` and that greedy outputs are the same; it samples the
server's RSS (before the load, after a warm-up round of every kind of request; after it, once idle;
and the peak). It prints a summary, writes the result as
JSON (``--out``), and exits 1 where anything failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from quickdraft.server.limits import DEFAULT_MAX_BODY_BYTES

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three prime numbers:", "The quick brown fox", "import numpy as np\n\n"]
QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Write a haiku about the sea.", "Explain gravity in one sentence.",
             "Say hello in French.", "What is the largest planet?"]
CAPS = [None, 0, 1, 2, 4]  # per-request speculation caps (None: the server's own)
FAILURE_SAMPLES = 20  # failures kept with their details in the result


def hostile_cases(model: str, max_body: int) -> list[tuple[str, str, bytes | None, int]]:
    """(name, path, raw body (None: a Content-Length over ``max_body`` with no body sent), expected
    status): what tests/server/test_edges.py, test_rss_after_bad_input.py and test_errors.py send."""
    m = model.encode()
    deep = b"[" * 10_000 + b"]" * 10_000
    chat = b'{"model": "%s", "messages": [{"role": "user", "content": %s}]%s}'
    comp = b'{"model": "%s", "prompt": %s%s}'
    long_text = b'"' + b"x " * 2_000_000 + b'"'  # 4 MB: refused from its byte count, never tokenized
    cases = [
        ("deep-body", "/v1/completions", deep, 400),
        ("deep-in-a-field", "/v1/chat/completions", chat % (m, deep, b""), 400),
        ("surrogate-content", "/v1/chat/completions", chat % (m, b'"\\ud800"', b""), 400),
        ("surrogate-prompt-list", "/v1/completions", comp % (m, b'["ok", "a\\udfffb"]', b""), 400),
        ("surrogate-stop", "/v1/completions", comp % (m, b'"Hi"', b', "stop": "\\uDBFF"'), 400),
        ("long-prompt", "/v1/completions", comp % (m, long_text, b', "max_tokens": 1'), 400),
        ("long-chat", "/v1/chat/completions", chat % (m, long_text, b""), 400),
        ("long-tokenize", "/tokenize", b'{"model": "%s", "prompt": %s}' % (m, long_text), 400),
        ("max-tokens-1e12-stream", "/v1/completions", comp % (m, b'"Hi"', b', "max_tokens": 1000000000000, "stream": true'), 400),
        ("max-tokens-2e70", "/v1/completions", comp % (m, b'"Hi"', b', "max_tokens": %d' % 2**70), 400),
        ("chat-max-tokens-1e12-stream", "/v1/chat/completions",
         chat % (m, b'"Hi"', b', "max_tokens": 1000000000000, "stream": true'), 400),
        ("body-over-the-limit-declared", "/v1/completions", None, 413),
        ("malformed-json", "/v1/completions", b'{"model": "%s", "prompt": ' % m, 400),
        ("not-utf8", "/v1/completions", b"\xff\xfe", 400),
        ("not-an-object", "/v1/chat/completions", b"[1, 2, 3]", 400),
        ("unknown-field", "/v1/completions", comp % (m, b'"Hi"', b', "max_tokenz": 3'), 400),
        ("string-max-tokens", "/v1/completions", comp % (m, b'"Hi"', b', "max_tokens": "5"'), 400),
        ("negative-temperature", "/v1/chat/completions", chat % (m, b'"Hi"', b', "temperature": -1'), 400),
        ("n-zero", "/v1/completions", comp % (m, b'"Hi"', b', "n": 0'), 400),
        ("bad-logit-bias", "/v1/completions", comp % (m, b'"Hi"', b', "logit_bias": {"999999999": 5}'), 400),
        ("bad-role", "/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "wizard", "content": "x"}]}' % m, 400),
        ("detokenize-out-of-vocab", "/detokenize", b'{"model": "%s", "tokens": [-1, 99999999]}' % m, 400),
        ("unknown-model", "/v1/completions", b'{"model": "gpt-5", "prompt": "Hi"}', 404),
        ("unknown-route", "/v1/embeddings", b'{"model": "%s", "input": "Hi"}' % m, 404),
    ]
    if max_body <= 8 * 2**20:  # a real body over the limit, where sending one is cheap enough
        cases.append(("body-over-the-limit", "/v1/completions", comp % (m, b'"Hi"', b" " * max_body), 413))
    return cases


@dataclass
class Tally:
    """What happened, by kind of request."""

    finished: Counter = field(default_factory=Counter)  # load requests answered in full, by kind
    statuses: Counter = field(default_factory=Counter)  # "kind status" -> count, every answer
    disconnects: Counter = field(default_factory=Counter)  # "stream" / "waiting"
    hostile: Counter = field(default_factory=Counter)  # hostile cases answered as expected, by name
    failures: Counter = field(default_factory=Counter)  # by reason
    samples: list = field(default_factory=list)
    tokens: int = 0

    def fail(self, reason: str, detail: str) -> None:
        self.failures[reason] += 1
        if len(self.samples) < FAILURE_SAMPLES:
            self.samples.append({"reason": reason, "detail": detail[:500], "t": round(time.time(), 1)})


class Soak:
    def __init__(self, args, url: str, model: str):
        import openai

        self.args, self.url, self.model = args, url, model
        self.tally = Tally()
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        timeout = httpx.Timeout(args.request_timeout, connect=30)
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0,
                                         timeout=timeout)
        self.http = httpx.AsyncClient(base_url=url, headers=self.headers, timeout=timeout)
        self.rng = random.Random(args.seed)
        self.deadline = 0.0

    # -- load ---------------------------------------------------------------------------------
    def _load_request(self) -> tuple[str, dict]:
        r = self.rng
        chat, stream = r.random() < 0.5, r.random() < 0.5
        body: dict = {"model": self.model, "max_tokens": r.choice([8, 16, 32, self.args.max_tokens]), "stream": stream}
        if r.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=r.randrange(2**31))
        extra = {}
        cap = r.choice(CAPS)
        if cap is not None:
            extra["speculative"] = {"num_speculative_tokens": cap}
        if chat:
            body["messages"] = [{"role": "user", "content": r.choice(QUESTIONS)}]
            if r.random() < 0.3:
                body.update(logprobs=True, top_logprobs=r.choice([1, 3]))
        else:
            body["prompt"] = r.choice(PROMPTS)
            if r.random() < 0.3:
                body["logprobs"] = r.choice([1, 3])
        if stream:
            body["stream_options"] = {"include_usage": True}
        kind = f"{'chat' if chat else 'completions'}{'-stream' if stream else ''}"
        return kind, {**body, "extra_body": extra}

    async def _create(self, body: dict):
        api = self.client.chat.completions if "messages" in body else self.client.completions
        return await api.create(**body)

    async def load_client(self) -> None:
        import openai

        while time.monotonic() < self.deadline:
            kind, body = self._load_request()
            try:
                if body["stream"]:
                    usage = None
                    async with await self._create(body) as stream:
                        async for chunk in stream:
                            usage = chunk.usage or usage
                    tokens = usage.completion_tokens if usage else 0
                else:
                    tokens = (await self._create(body)).usage.completion_tokens
                self.tally.statuses[f"{kind} 200"] += 1
                self.tally.finished[kind] += 1
                self.tally.tokens += tokens
            except openai.APIStatusError as e:
                self.tally.statuses[f"{kind} {e.status_code}"] += 1
                if e.status_code != 429:
                    self.tally.fail(f"load {e.status_code}", f"{kind}: {e.message}")
            except openai.APIError as e:  # a dropped connection, a timeout, an error event in a stream
                self.tally.fail(f"load {type(e).__name__}", f"{kind}: {e}")

    async def disconnecting_client(self) -> None:
        """Streams cut after a few chunks, and non-streaming requests given up while they wait."""
        import openai

        while time.monotonic() < self.deadline:
            kind, body = self._load_request()
            body["max_tokens"] = self.args.max_tokens
            try:
                if body["stream"]:
                    stream = await self._create(body)
                    seen, keep = 0, self.rng.randint(1, 4)
                    async for _ in stream:
                        seen += 1
                        if seen >= keep:
                            break
                    await stream.close()  # the connection closes mid-stream
                    self.tally.disconnects["stream"] += 1
                else:
                    try:
                        await asyncio.wait_for(self._create(body), timeout=self.rng.uniform(0.2, 2.0))
                        self.tally.finished[kind] += 1  # finished before we gave up
                    except asyncio.TimeoutError:
                        self.tally.disconnects["waiting"] += 1
            except openai.APIStatusError as e:
                self.tally.statuses[f"{kind} {e.status_code}"] += 1
                if e.status_code != 429:
                    self.tally.fail(f"disconnect {e.status_code}", f"{kind}: {e.message}")
            except openai.APIError as e:
                self.tally.fail(f"disconnect {type(e).__name__}", f"{kind}: {e}")
            await asyncio.sleep(self.rng.uniform(0, 0.5))

    # -- hostile input ----------------------------------------------------------------------------
    async def _over_the_limit(self, path: str) -> tuple[int, bytes]:
        """A POST declaring a body over the limit, none sent: the answer must come unread."""
        host, port = httpx.URL(self.url).host, httpx.URL(self.url).port
        reader, writer = await asyncio.open_connection(host, port)
        try:
            head = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
                    f"Content-Length: {self.args.max_body_bytes + 1}", "Connection: close",
                    *(f"{k}: {v}" for k, v in self.headers.items())]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
            await writer.drain()
            reply = await asyncio.wait_for(reader.read(), timeout=self.args.request_timeout)
        finally:
            writer.close()
        status_line, _, rest = reply.partition(b"\r\n")
        return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]

    async def hostile_client(self) -> None:
        cases = hostile_cases(self.model, self.args.max_body_bytes)
        i = 0
        while time.monotonic() < self.deadline:
            await self._hostile(cases[i % len(cases)])
            i += 1
            await asyncio.sleep(self.args.hostile_interval)

    async def _hostile(self, case) -> None:
        """Send one hostile case and check its status and error body."""
        name, path, body, want = case
        try:
            if body is None:
                status, text = await self._over_the_limit(path)
            else:
                r = await self.http.post(path, content=body, headers={"Content-Type": "application/json"})
                status, text = r.status_code, r.content
            self.tally.statuses[f"hostile {status}"] += 1
            err = json.loads(text).get("error") if text else None
            if status != want:
                self.tally.fail(f"hostile {status}", f"{name}: wanted {want}, got {status}: {text[:300]!r}")
            elif not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
                self.tally.fail("hostile format", f"{name}: not OpenAI's error format: {text[:300]!r}")
            else:
                self.tally.hostile[name] += 1
        except (httpx.HTTPError, OSError, ValueError, asyncio.TimeoutError) as e:
            self.tally.fail(f"hostile {type(e).__name__}", f"{name}: {e}")

    async def warm_up(self) -> None:
        """One of each hostile case and a round of load, before RSS is first read: first-use
        allocations (JSON and tokenizer buffers, a batch's workspaces) belong in both figures."""
        self.deadline = time.monotonic() + 1
        await asyncio.gather(*(self.load_client() for _ in range(self.args.concurrency)))
        for case in hostile_cases(self.model, self.args.max_body_bytes):
            await self._hostile(case)

    # -- checks -----------------------------------------------------------------------------------
    async def greedy(self) -> list[str]:
        """Greedy outputs, one request at a time: chat and completions, plain and speculating."""
        outs = []
        for prompt, question in zip(PROMPTS[:3], QUESTIONS[:3]):
            for cap in (0, None):
                extra = {} if cap is None else {"speculative": {"num_speculative_tokens": cap}}
                c = await self.client.completions.create(model=self.model, prompt=prompt, max_tokens=24, temperature=0,
                                                         extra_body=extra)
                outs.append(c.choices[0].text)
                c = await self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0,
                    extra_body=extra)
                outs.append(c.choices[0].message.content)
        return outs

    async def health(self) -> dict:
        r = await self.http.get("/health")
        return {"status_code": r.status_code, **r.json()}

    async def idle(self, timeout: float) -> dict:
        """/health once nothing runs or waits (the aborted requests' slots freed), or at the timeout."""
        end = time.monotonic() + timeout
        while True:
            h = await self.health()
            if (h.get("running") == 0 and h.get("waiting") == 0) or time.monotonic() > end:
                return h
            await asyncio.sleep(0.5)


class Rss:
    """The server's resident memory, sampled every second by a thread of its own."""

    def __init__(self, pid: int | None):
        import psutil

        self.proc = psutil.Process(pid) if pid else None
        self.peak = 0

    def now(self) -> int | None:
        if self.proc is None:
            return None
        rss = self.proc.memory_info().rss
        self.peak = max(self.peak, rss)
        return rss

    async def watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.now)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass


def _mib(b: int | None) -> float | None:
    return None if b is None else round(b / 2**20, 1)


async def soak(args, url: str, pid: int | None) -> dict:
    h = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {},
                  timeout=60).json()
    model = h["data"][0]["id"]
    s = Soak(args, url, model)
    rss = Rss(pid)
    health_before = await s.health()
    greedy_before = await s.greedy()
    await s.warm_up()
    rss_before = rss.now()
    s.deadline = time.monotonic() + args.duration
    stop = asyncio.Event()
    watcher = asyncio.create_task(rss.watch(stop))
    tasks = [*(s.load_client() for _ in range(args.concurrency)),
             *(s.disconnecting_client() for _ in range(args.disconnect_clients)), s.hostile_client()]
    started = time.monotonic()
    work = asyncio.gather(*tasks)
    await _progress(s, work, args.duration, args.quiet)
    await work
    load_s = time.monotonic() - started
    health_after = await s.idle(timeout=120)
    await asyncio.sleep(2)  # what the aborted requests held is freed at the engine's next step
    rss_after = rss.now()
    stop.set()
    await watcher
    greedy_after = await s.greedy()
    await s.client.close()
    await s.http.aclose()
    t = s.tally
    deterministic = greedy_before == greedy_after
    ok = not t.failures and deterministic and health_before.get("status") == health_after.get("status") == "ok"
    return {
        "ok": ok, "model": model, "duration_s": args.duration, "load_s": round(load_s, 1),
        "requests_finished": sum(t.finished.values()), "finished_by_kind": dict(t.finished),
        "completion_tokens": t.tokens, "disconnects": dict(t.disconnects),
        "hostile_as_expected": sum(t.hostile.values()), "hostile_by_case": dict(t.hostile),
        "statuses": dict(sorted(t.statuses.items())), "failures": dict(t.failures), "failure_samples": t.samples,
        "rss_mib": {"before": _mib(rss_before), "after": _mib(rss_after), "peak": _mib(rss.peak or None)},
        "health": {"before": health_before, "after": health_after},
        "greedy_deterministic": deterministic, "greedy_outputs": len(greedy_before),
    }


async def _progress(s: Soak, work: asyncio.Future, duration: float, quiet: bool) -> None:
    from tqdm import tqdm

    bar = tqdm(total=int(duration), unit="s", desc="soak", disable=quiet, mininterval=5, file=sys.stderr)
    start = time.monotonic()
    while not work.done():
        done = min(int(time.monotonic() - start), int(duration))
        bar.update(done - bar.n)
        t = s.tally
        bar.set_postfix(done=sum(t.finished.values()), cut=sum(t.disconnects.values()),
                        hostile=sum(t.hostile.values()), failed=sum(t.failures.values()), refresh=False)
        await asyncio.wait([work], timeout=1.0)
    bar.close()


def start_server(args) -> tuple[subprocess.Popen, str, Path]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "quickdraft.cli", "serve", args.model, "--dtype", args.dtype,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs), "--max-body-bytes", str(args.max_body_bytes),
           "--no-access-log", "--log-level", "warning"]
    if args.speculative_config != "none":
        cmd += ["--speculative-config", args.speculative_config, "--speculative-disable-by-batch-size", "0"]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    cmd += args.serve_arg
    log = Path(args.server_log)
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not come up in {args.startup_timeout} s; see {log}")


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def summary(r: dict) -> str:
    rss = r["rss_mib"]
    lines = [f"soak {'passed' if r['ok'] else 'FAILED'}: {r['load_s']:.0f} s of load on {r['model']}",
             f"  requests finished: {r['requests_finished']} ({r['completion_tokens']} completion tokens); "
             f"disconnects: {r['disconnects']}; hostile answered as expected: {r['hostile_as_expected']}",
             f"  statuses: {r['statuses']}",
             f"  failures: {r['failures'] or 'none'}",
             f"  RSS MiB: before {rss['before']}, after {rss['after']}, peak {rss['peak']}",
             f"  health: {r['health']['before'].get('status')} before, {r['health']['after'].get('status')} after; "
             f"greedy outputs equal before and after: {r['greedy_deterministic']} ({r['greedy_outputs']} outputs)"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m quickdraft.bench.soak", description=__doc__.split("\n\n")[0],
                                epilog="A failure: any 5xx, dropped connection, timeout, stream error event, or an "
                                       "unexpected status. Exit status 1 where one happened.")
    p.add_argument("--duration", type=float, default=1800, help="seconds of load (default 1800)")
    p.add_argument("--url", default=None, help="target a running server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's process id, for its RSS")
    p.add_argument("--api-key", default=None, help="the server's key (a started server gets this one)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the model a started server serves")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}',
                   help='a started server\'s --speculative-config, or "none"')
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="the server's --max-body-bytes: a body just over it must get a 413")
    p.add_argument("--serve-arg", action="append", default=[], help="an extra argument for quickdraft serve")
    p.add_argument("--concurrency", type=int, default=4, help="load clients (default 4)")
    p.add_argument("--disconnect-clients", type=int, default=1, help="clients that go away mid-request (default 1)")
    p.add_argument("--hostile-interval", type=float, default=0.2, help="seconds between hostile requests")
    p.add_argument("--max-tokens", type=int, default=64, help="the longest completion a load request asks for")
    p.add_argument("--request-timeout", type=float, default=600, help="a request with no answer by then fails")
    p.add_argument("--startup-timeout", type=float, default=1800)
    p.add_argument("--seed", type=int, default=0, help="the seed of the request mix")
    p.add_argument("--server-log", default="soak-server.log", help="a started server's log")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc, log = None, None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url, log = start_server(args)
        pid = proc.pid
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        result = asyncio.run(soak(args, url, pid))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if log is not None:
        text = log.read_text(errors="replace")
        result["server_log_tracebacks"] = text.count("Traceback")
        result["ok"] = result["ok"] and result["server_log_tracebacks"] == 0
    result.update(started=started, command=" ".join(["python -m quickdraft.bench.soak", *(argv or sys.argv[1:])]),
                  cpu=cpu_name(), args=vars(args))
    print(summary(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
