"""llama.cpp's own speculation as a peer: ``llama-server``, plain and with its speculative modes.

llama-cpp-python (the ``llama_cpp`` peer) drives llama.cpp's decoder, but its speculation is a
Python loop of its own; llama.cpp's is in its server. This peer starts ``llama-server`` on
127.0.0.1 (a free port), one server a mode, each loaded once and kept for the whole run, and sends
the bench's prompts to ``/completion`` as the prompt's token ids, greedy:

- ``plain``: no speculation;
- ``draft``: the same draft file quickdraft uses (``-md``, ``--spec-type draft-simple``), K tokens a
  step at most (``--spec-draft-n-max`` = the peers' K, ``--spec-draft-n-min 0``);
- its n-gram modes, each drafting at most K tokens from n-grams of the bench's longest n-gram size
  (``ngram-simple``, ``ngram-map-k``, ``ngram-mod``), and ``ngram-cache`` (llama-lookup's cache,
  8 tokens: its length is fixed in this version).

Threads: the count quickdraft runs on (``-t``, ``-tb``, and the draft's ``-td``, ``-tbd``).
Requests never reuse an earlier one's prompt (``cache_prompt: false``); the tokens come back as
ids (``return_tokens``). Timing is the server's own, which this version defines as quickdraft
does: ``prompt_ms`` runs from the request's start to its first token (TTFT) and ``predicted_ms``
from the first token to the last, so tokens/s counts the tokens after the first over it (the
server's ``predicted_per_second`` is kept beside it). HTTP's own time is left out of both.

The binary is ``$QUICKDRAFT_LLAMA_SERVER``, else
``$QUICKDRAFT_CACHE/llama-server/<isa>/bin/llama-server`` (``make llama-server`` builds it there
from the llama.cpp that llama-cpp-python vendors; ``<isa>`` is ``$QUICKDRAFT_ISA`` or ``native``).
The flags are this version's (llama-cpp-python 0.3.36's llama.cpp): another build may name them
otherwise, and then its servers fail to start and the peer is noted as failed.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from quickdraft.bench.peer_method import PeerMethod

PEER = "llama_server"
BINARY_ENV = "QUICKDRAFT_LLAMA_SERVER"
SOURCE = "llama-cpp-python==0.3.36"  # the sdist whose vendor/llama.cpp `make llama-server` builds
NGRAM_CACHE_DRAFT = 8  # ngram-cache's draft length in this version (common/speculative.cpp: a constant)
READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Mode:
    """One server's way of decoding: its method name in the bench and its flags."""

    method: str  # plain | draft | ngram_simple | ngram_map_k | ngram_mod | ngram_cache
    flags: tuple[str, ...] = ()
    settings: dict = field(default_factory=dict, hash=False, compare=False)


def binary() -> Path | None:
    """The llama-server to run, or None when there is none."""
    given = os.environ.get(BINARY_ENV)
    if given:
        return Path(given) if Path(given).is_file() else None
    root = Path(os.environ.get("QUICKDRAFT_CACHE") or Path.home() / ".cache" / "quickdraft")
    path = root / "llama-server" / (os.environ.get("QUICKDRAFT_ISA") or "native") / "bin" / "llama-server"
    return path if path.is_file() else None


def modes(draft: str | None, k: int, lookup_max: int) -> list[Mode]:
    """Plain, the draft model (when the draft is a .gguf file) and the n-gram modes."""
    out = [Mode("plain")]
    if draft is not None and str(draft).endswith(".gguf") and Path(draft).is_file():
        out.append(Mode("draft", ("-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
                                  "--spec-draft-n-min", "0", "-ngld", "0"), {"k": k, "n_min": 0}))
    n = str(lookup_max)
    out += [
        Mode("ngram_simple", ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", n,
                              "--spec-ngram-simple-size-m", str(k)), {"k": k, "size_n": lookup_max}),
        Mode("ngram_map_k", ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", n,
                             "--spec-ngram-map-k-size-m", str(k)), {"k": k, "size_n": lookup_max}),
        Mode("ngram_mod", ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", n, "--spec-ngram-mod-n-max", str(k),
                           "--spec-ngram-mod-n-min", "1"), {"k": k, "n_match": lookup_max, "n_min": 1}),
        Mode("ngram_cache", ("--spec-type", "ngram-cache"), {"k": NGRAM_CACHE_DRAFT}),
    ]
    return out


def command(exe: str | Path, target: str, mode: Mode, threads: int, n_ctx: int, port: int,
            slots: int = 1) -> list[str]:
    """llama-server's command line for one mode: ``slots`` requests decoded at a time (``-np``,
    continuous batching), each with the context of quickdraft's engines (``-c`` is all the slots'
    together), everything on the CPU."""
    cmd = [str(exe), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "-c", str(n_ctx * slots),
           "-np", str(slots), "-t", str(threads), "-tb", str(threads), "-ngl", "0"]
    if mode.method == "draft":
        cmd += ["-td", str(threads), "-tbd", str(threads)]
    return cmd + list(mode.flags)


def request_body(ids: list[int], max_tokens: int, ignore_eos: bool) -> dict:
    """/completion's request: the prompt as token ids, greedy, no samplers that change a logit,
    no reuse of an earlier prompt, the tokens back as ids."""
    return {"prompt": [int(t) for t in ids], "n_predict": int(max_tokens), "temperature": 0.0, "top_k": 1,
            "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "ignore_eos": bool(ignore_eos),
            "cache_prompt": False, "return_tokens": True, "stream": False}


def parse_response(resp: dict, eos: set[int], max_tokens: int, wall_s: float) -> dict:
    """/completion's answer -> a peer run: the tokens up to the first end-of-sequence token (at
    most ``max_tokens``), the server's timings and its draft counters."""
    if "tokens" not in resp or "timings" not in resp:
        raise ValueError(f"llama-server's answer has no {'tokens' if 'tokens' not in resp else 'timings'}: "
                         f"{json.dumps(resp)[:200]}")
    out = []
    for t in resp["tokens"]:
        if t in eos or len(out) >= max_tokens:
            break
        out.append(int(t))
    t = resp["timings"]
    seconds = float(t.get("predicted_ms") or 0.0) / 1000
    ttft = float(t.get("prompt_ms") or 0.0) / 1000
    n = len(out)
    return {"token_ids": out, "num_tokens": n, "ttft_s": ttft, "seconds": seconds, "total_seconds": wall_s,
            "tokens_per_second": (n - 1) / seconds if n > 1 and seconds > 0 else 0.0,
            "server_tokens_per_second": float(t.get("predicted_per_second") or 0.0),
            "num_prompt_tokens_computed": int(t.get("prompt_n") or 0), "num_prompt_tokens_cached": int(t.get("cache_n") or 0),
            "num_draft_tokens": int(t.get("draft_n") or 0), "num_accepted_tokens": int(t.get("draft_n_accepted") or 0),
            "stop_type": resp.get("stop_type")}


def parse_system_info(text: str) -> dict:
    """ggml's system info line (``CPU : SSE3 = 1 | AVX2 = 1 | ...``) -> {feature: 0/1}."""
    features = {}
    for part in text.replace("\n", "|").split("|"):
        if "=" in part:
            key, _, value = part.rpartition("=")
            key = key.split(":")[-1].strip()
            if key and value.strip().isdigit():
                features[key] = int(value.strip())
    return features


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # in the server's process, before exec: killed when the peer's child dies
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 -- not Linux: the process group's kill still reaches it
        pass


class Server:
    """One llama-server process and its HTTP endpoint."""

    def __init__(self, cmd: list[str], port: int, name: str):
        self.cmd, self.port, self.name = cmd, port, name
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"llama-server-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until /health answers 200 (503 while the model loads); raises with the log's tail when
        the server exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"llama-server ({self.name}) exited with code {code} while starting:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"llama-server ({self.name}) not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def post(self, path: str, body: dict, timeout: float = 3600.0) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server ({self.name}) answered {e.code}: {e.read()[:300]!r}") from None
        except (urllib.error.URLError, ConnectionError) as e:
            code = self.proc.poll()
            raise RuntimeError(f"llama-server ({self.name}) did not answer ({e}); exit code {code}:\n"
                               f"{self.log_tail()}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


def version(exe: str | Path) -> str:
    """``llama-server --version``'s first line (``version: N (commit)``)."""
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"
    lines = [x.strip() for x in (out.stdout + out.stderr).splitlines() if x.strip().startswith("version")]
    return lines[0] if lines else "unknown"


def llama_server_methods(exe: str | Path, target: str, draft: str | None, k: int, lookup_max: int, max_tokens: int,
                         eos: set[int], ignore_eos: bool, threads: int, n_ctx: int) -> tuple[list, list[Server]]:
    """One server a mode, each started and ready; their PeerMethods and the servers (to close)."""
    if Path(target).is_dir() or not str(target).endswith(".gguf"):
        raise ValueError("llama-server reads GGUF files only, and the target is not one")
    servers: list[Server] = []
    atexit.register(lambda: [s.close() for s in servers])
    methods = []
    for mode in modes(draft, k, lookup_max):
        port = free_port()
        server = Server(command(exe, target, mode, threads, n_ctx, port), port, mode.method)
        servers.append(server)
        server.wait_ready()

        def generate(ids: list[int], server=server) -> dict:
            start = time.perf_counter()
            resp = server.post("/completion", request_body(ids, max_tokens, ignore_eos))
            return parse_response(resp, eos, max_tokens, time.perf_counter() - start)

        methods.append(PeerMethod(PEER, mode.method, dict(mode.settings), generate))
    return methods, servers


def llama_server_peer(spec: dict) -> tuple[list, dict]:
    """The child's factory (quickdraft/bench/peers.py): llama-server's modes and which build ran them."""
    exe = binary()
    if exe is None:
        raise FileNotFoundError(f"no llama-server: build it with `make llama-server`, or set ${BINARY_ENV}")
    methods, servers = llama_server_methods(exe, spec["target"], spec["draft"], spec["k"], spec["lookup_max"],
                                            spec["max_tokens"], set(spec["eos"]), spec["ignore_eos"],
                                            spec["threads"], spec["n_ctx"])
    info = next((x.split("system_info:", 1)[1].strip() for x in servers[0].log_text().splitlines()
                 if "system_info:" in x), "")
    system = {"version": f"{version(exe)}, from {SOURCE}", "binary": str(exe), "threads": spec["threads"],
              "system_info": info, "features": parse_system_info(info),
              "commands": {m.method: s.cmd for m, s in zip(methods, servers)}}
    print(f"llama-server {system['version']}: {info}", file=sys.stderr, flush=True)
    return methods, system
