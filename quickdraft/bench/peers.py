"""The engines people would use instead, on the same weights and the same prompt token ids.

- ``transformers``: the target's GGUF dequantized by Hugging Face transformers
  (``from_pretrained(dir, gguf_file=...)``, in the bench's dtype): plain greedy ``generate``,
  assisted generation with the same draft (``assistant_model=``, K draft tokens a step, the
  constant schedule and no confidence cut-off, like quickdraft's fixed K) and prompt lookup
  (``prompt_lookup_num_tokens=K``, ``max_matching_ngram_size`` = the n-gram size).
- ``llama.cpp`` through ``llama-cpp-python``: the GGUF as it is (quantized: it reads fewer bytes
  per token than a bfloat16 engine), plain greedy decoding and its prompt lookup draft
  (``LlamaPromptLookupDecoding``).
- ``llama_server``: llama.cpp's own server (``llama-server``, built by ``make llama-server``) on
  the same GGUF, plain and with its own speculation: the same draft file (``-md``) and its n-gram
  modes (quickdraft/bench/llama_server.py).

"llama.cpp plain" and "llama.cpp best" (``llama_cpp_best``) are the fastest plain method and the
fastest method of all of llama.cpp's, over both llama.cpp peers, per data set: the report sets
them side by side.

Each is an optional extra (``pip install quickdraft[peers]``); a peer that is not installed, or
cannot read the model, is skipped with a note. Peers run greedy only, after quickdraft's runs (the
quickdraft engines are freed first), each request once per peer method after a warm-up. Timing
follows quickdraft's: tokens/s counts the tokens after the first over the time from the first
token to the last; the first token's time comes from a streamer (transformers) or the first
token the generator yields (llama.cpp).

Each peer runs in a child process (``python -m quickdraft.bench.peers``) under a time limit
(``--peer-timeout``): a peer that crashes (llama.cpp's AMX kernels segfault on some Intel Xeons),
hangs, raises or is missing becomes a note and a ``peers.status`` entry, and the rest of the run
is kept. The child streams one JSON line per finished request to the parent, so a peer that dies
mid-run keeps the requests it finished (every one of its methods ran them).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from quickdraft.bench.llama_server import parse_system_info
from quickdraft.bench.peer_method import COUNTERPART, PeerMethod
from quickdraft.bench.summary import ALL, groups
from quickdraft.evaluation import stats

PEERS = ("transformers", "llama_cpp", "llama_server")
LLAMA_CPP_PEERS = ("llama_cpp", "llama_server")  # the peers that are llama.cpp
# peer -> "module:function" that builds its methods in the child (tests add fakes here)
FACTORIES = {"transformers": "quickdraft.bench.peers:transformers_peer",
             "llama_cpp": "quickdraft.bench.peers:llama_cpp_peer",
             "llama_server": "quickdraft.bench.llama_server:llama_server_peer"}
# a peer is installed when its module is (llama_server: when its binary is, llama_server.binary)
MODULES = {"transformers": "transformers", "llama_cpp": "llama_cpp"}
INSTALL = {"transformers": "pip install 'quickdraft[peers]', or transformers accelerate",
           "llama_cpp": "pip install 'quickdraft[peers]', or llama-cpp-python",
           "llama_server": "make llama-server, or $QUICKDRAFT_LLAMA_SERVER"}
DEFAULT_TIMEOUT_S = 1800.0



def _timing(ids_out: list[int], start: float, first: float | None, end: float) -> dict:
    n = len(ids_out)
    first = first if first is not None else end
    seconds = end - first
    return {"token_ids": ids_out, "num_tokens": n, "ttft_s": first - start, "seconds": seconds,
            "total_seconds": end - start, "tokens_per_second": (n - 1) / seconds if n > 1 and seconds > 0 else 0.0}


def _cut(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


# -- transformers ---------------------------------------------------------------------------------

def _hf_load(source: str, dtype):
    import transformers
    from transformers import AutoModelForCausalLM

    path = Path(source)
    kw = {"dtype": dtype} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dtype}
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    return model.eval()


def transformers_methods(target: str, draft: str | None, dtype, k: int, lookup_max: int, max_tokens: int,
                         eos: set[int], ignore_eos: bool) -> list[PeerMethod]:
    """Plain, assisted (when there is a draft) and prompt lookup generation; target and draft are
    a .gguf file or a Hugging Face directory."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """Times the first generated token: generate puts the prompt first, then new tokens."""

        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self):
            pass

    model = _hf_load(target, dtype)
    eos_list = sorted(eos)
    base = {"max_new_tokens": max_tokens, "do_sample": False, "pad_token_id": eos_list[0] if eos_list else 0}
    base.update({"min_new_tokens": max_tokens} if ignore_eos else {"eos_token_id": eos_list})

    def runner(extra: dict) -> Callable[[list[int]], dict]:
        def generate(ids: list[int]) -> dict:
            x = torch.tensor([ids], dtype=torch.long)
            clock = Clock()
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), streamer=clock, **base, **extra)
            end = time.perf_counter()
            return _timing(_cut(out[0, len(ids):].tolist(), set() if ignore_eos else eos), start, clock.first, end)

        return generate

    methods = [PeerMethod("transformers", "plain", {}, runner({}))]
    if draft is not None:
        assistant = _hf_load(draft, dtype)
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        methods.append(PeerMethod("transformers", "assisted", {"k": k, "schedule": "constant",
                                                               "assistant_confidence_threshold": 0.0},
                                  runner({"assistant_model": assistant})))
    methods.append(PeerMethod("transformers", "prompt_lookup", {"k": k, "max_matching_ngram_size": lookup_max},
                              runner({"prompt_lookup_num_tokens": k, "max_matching_ngram_size": lookup_max})))
    return methods


def transformers_peer(spec: dict) -> tuple[list[PeerMethod], dict]:
    """The child's factory: transformers' methods and what ran them."""
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    methods = transformers_methods(spec["target"], spec["draft"], getattr(torch, spec["dtype"]), spec["k"],
                                   spec["lookup_max"], spec["max_tokens"], set(spec["eos"]), spec["ignore_eos"])
    return methods, {"version": transformers.__version__, "torch": torch.__version__,
                     "torch_threads": torch.get_num_threads()}


# -- llama.cpp ----------------------------------------------------------------------------------

def llama_cpp_methods(target: str, k: int, lookup_max: int, max_tokens: int, eos: set[int], threads: int,
                      n_ctx: int) -> list[PeerMethod]:
    """Plain and prompt lookup decoding on the target's .gguf file."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if Path(target).is_dir():
        raise ValueError("llama.cpp reads GGUF files only, and the target is a Hugging Face directory")

    def load(**kw):
        return Llama(model_path=target, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                     verbose=False, **kw)

    def runner(llm) -> Callable[[list[int]], dict]:
        def generate(ids: list[int]) -> dict:
            llm.reset()  # no reuse of an earlier request's prefix: every request pays its prompt
            out, first = [], None
            start = time.perf_counter()
            for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                if first is None:
                    first = time.perf_counter()
                if token in eos:
                    break
                out.append(int(token))
                if len(out) >= max_tokens:
                    break
            return _timing(out, start, first, time.perf_counter())

        return generate

    lookup = LlamaPromptLookupDecoding(num_pred_tokens=k, max_ngram_size=lookup_max)
    return [PeerMethod("llama_cpp", "plain", {}, runner(load())),
            PeerMethod("llama_cpp", "prompt_lookup", {"k": k, "max_ngram_size": lookup_max},
                       runner(load(draft_model=lookup)))]


def llama_cpp_system() -> dict:
    """Which llama.cpp ran: the package version and ggml's system info (the CPU features it was
    built with, e.g. ``AVX512 = 1 | AMX_INT8 = 0``), parsed into ``features`` too."""
    import llama_cpp

    info: dict = {"version": getattr(llama_cpp, "__version__", None)}
    try:
        raw = llama_cpp.llama_print_system_info()
        text = (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).strip()
    except Exception as e:  # an older binding without it
        text = f"unavailable: {type(e).__name__}: {e}"
    info["system_info"] = text
    info["features"] = parse_system_info(text)
    return info


def llama_cpp_peer(spec: dict) -> tuple[list[PeerMethod], dict]:
    """The child's factory: llama.cpp's methods and which build ran them."""
    system = llama_cpp_system()  # first: a crash while loading still leaves it on stderr
    print(f"llama.cpp {system['version']}: {system['system_info']}", file=sys.stderr, flush=True)
    return llama_cpp_methods(spec["target"], spec["k"], spec["lookup_max"], spec["max_tokens"], set(spec["eos"]),
                             spec["threads"], spec["n_ctx"]), system


# -- the child ----------------------------------------------------------------------------------

def _resolve(ref: str) -> Callable:
    module, _, name = ref.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def child_main(spec: dict, send: Callable[[dict], None]) -> None:
    """In the child: build the peer's methods, warm each up, then run every request with every
    method (rotated per request, as quickdraft's variants are) and send one line per request."""
    methods, system = _resolve(spec["factory"])(spec)
    send({"event": "methods", "methods": [m.info() for m in methods], "system": system})
    requests = spec["requests"]
    if not methods or not requests:
        return
    for m in methods:  # warm-up, as for quickdraft's engines
        m.generate(requests[0]["prompt_token_ids"][:64])
    send({"event": "warm"})
    for i, req in enumerate(requests):
        rot = i % len(methods)
        runs = []
        for m in methods[rot:] + methods[:rot]:
            runs.append({"request": req["id"], "peer": m.peer, "method": m.method, "name": m.name,
                         **m.generate(req["prompt_token_ids"])})
            send({"event": "progress", "name": m.name})
        send({"event": "request", "request": req["id"], "runs": runs})


def _child() -> int:
    """``python -m quickdraft.bench.peers``: the spec as JSON on stdin, JSON lines on stdout."""
    import faulthandler

    faulthandler.enable()  # a segfault leaves the Python stack on stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed (by C code too) goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    spec = json.loads(sys.stdin.read())
    for p in reversed(spec.get("sys_path", [])):
        if p not in sys.path:
            sys.path.insert(0, p)

    def send(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    try:
        child_main(spec, send)
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, then a non-zero exit
        send({"event": "error", "error": f"{type(e).__name__}: {e}"})
        raise
    send({"event": "done"})
    return 0


# -- the parent ---------------------------------------------------------------------------------

def _installed(peer: str) -> bool:
    if peer == "llama_server":
        from quickdraft.bench.llama_server import binary

        return binary() is not None
    module = MODULES.get(peer)
    return module is None or importlib.util.find_spec(module) is not None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def run_child(peer: str, spec: dict, timeout: float, on_event: Callable[[dict], None] | None = None) -> dict:
    """Run one peer in ``python -m quickdraft.bench.peers`` under ``timeout`` seconds. Returns its
    status: ok | error | crashed | timed_out, the exit code (negative: the signal), the requests
    it finished (``runs``), its methods and system info, and the tail of its stderr."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "quickdraft.bench.peers"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    tail: deque[str] = deque(maxlen=40)

    def pump_out():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def pump_err():
        for line in proc.stderr:
            tail.append(line.rstrip("\n"))

    readers = [threading.Thread(target=pump_out, daemon=True), threading.Thread(target=pump_err, daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
    except BrokenPipeError:
        pass
    status = {"peer": peer, "status": "ok", "exit_code": None, "signal": None, "error": None,
              "methods": [], "system": {}, "runs": [], "requests_finished": 0,
              "requests_total": len(spec["requests"]), "timeout_s": timeout}
    timed_out, done = False, False
    while True:
        left = timeout - (time.perf_counter() - started)
        if left <= 0:
            timed_out = True
            break
        try:
            line = lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        if line is None:
            break
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            tail.append(line.rstrip("\n"))
            continue
        event = msg.get("event")
        if event == "methods":
            status["methods"], status["system"] = msg["methods"], msg.get("system") or {}
        elif event == "request":
            status["runs"] += msg["runs"]
            status["requests_finished"] += 1
        elif event == "error":
            status["error"] = msg["error"]
        elif event == "done":
            done = True
        if on_event is not None:
            on_event(msg)
    if timed_out:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
        except (ProcessLookupError, PermissionError):
            proc.kill()
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    for t in readers:
        t.join(timeout=5)
    status["exit_code"], status["seconds"] = code, time.perf_counter() - started
    status["stderr_tail"] = list(tail)[-20:]
    if timed_out:
        status["status"] = "timed_out"
    elif code < 0 or code >= 128:  # killed by a signal, or a shell's 128 + signal (os._exit(139))
        status["status"], status["signal"] = "crashed", -code if code < 0 else code - 128
    elif code != 0 or not done:
        status["status"] = "error"
        if status["error"] is None:
            status["error"] = next((x for x in reversed(tail) if x.strip()), f"exit code {code}")
    return status


def _note(s: dict) -> str | None:
    peer, n, total = s["peer"], s["requests_finished"], s["requests_total"]
    if s["status"] == "ok":
        return None
    kept = (f"the {n} request(s) it finished are kept (every method of it ran them), the rest of its figures "
            f"are left out" if n else "its figures are left out")
    where = f"after {n} of {total} requests" if s["methods"] else "while loading"
    if s["status"] == "crashed":
        sig = s["signal"]
        return f"peer {peer} crashed (signal {sig} {_signal_name(sig)}, exit {s['exit_code']}) {where}; {kept}"
    if s["status"] == "timed_out":
        return (f"peer {peer} timed out: killed after {s['timeout_s']:.0f} s (--peer-timeout) {where}; {kept}")
    if not s["methods"]:
        return f"peer {peer} skipped: it could not load the model: {s['error']}"
    return f"peer {peer} failed {where}: {s['error']}; {kept}"


def _public(s: dict) -> dict:
    """A status as results.json keeps it: without the runs (they are in ``peers.runs``)."""
    return {k: v for k, v in s.items() if k != "runs"}


def run_peers(config, target: str, draft: str | None, eos: set[int], requests, qd_runs: list[dict],
              notes: list[str], progress: bool) -> dict:
    """Every peer method on every request (greedy), each peer in a child process under
    ``config.peer_timeout``, and their summary beside quickdraft's runs."""
    from tqdm import tqdm

    if not config.greedy:
        notes.append("peers skipped: they are compared at temperature 0 only")
        return {"methods": [], "runs": [], "summary": [], "status": []}
    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:
        threads = os.cpu_count() or 1
    from quickdraft.config import EngineConfig

    dtype = str(EngineConfig(model=config.model, dtype=config.dtype).torch_dtype).replace("torch.", "")
    lookup_max = next((v.lookup_max for v in config.variants if v.method == "ngram"), 4)
    eos = set() if config.ignore_eos else eos
    base = {"target": target, "draft": draft, "dtype": dtype, "k": config.peer_k, "lookup_max": lookup_max,
            "max_tokens": config.max_tokens, "eos": sorted(eos), "ignore_eos": config.ignore_eos,
            "threads": threads, "n_ctx": config.max_model_len, "sys_path": [p for p in sys.path if p],
            "requests": [{"id": r.id, "prompt_token_ids": r.prompt_token_ids} for r in requests]}
    timeout = getattr(config, "peer_timeout", None) or DEFAULT_TIMEOUT_S
    methods, runs, statuses = [], [], []
    for peer in config.peers:
        if not _installed(peer):
            notes.append(f"peer {peer} skipped: not installed ({INSTALL.get(peer, peer)})")
            statuses.append({"peer": peer, "status": "missing", "requests_finished": 0,
                             "requests_total": len(requests)})
            continue
        bar = tqdm(total=None, desc=f"peer {peer}", unit="run", disable=not progress)

        def on_event(msg, bar=bar):
            if msg.get("event") == "methods":
                bar.total = len(msg["methods"]) * len(requests)
                bar.refresh()
            elif msg.get("event") == "progress":
                bar.set_postfix_str(msg["name"][:40], refresh=False)
                bar.update(1)

        status = run_child(peer, {**base, "factory": FACTORIES[peer]}, timeout, on_event)
        bar.close()
        methods += status["methods"]
        runs += status["runs"]
        note = _note(status)
        if note:
            notes.append(note)
        statuses.append(_public(status))
    return {"methods": methods, "runs": runs, "status": statuses,
            "summary": summarize(methods, runs, [r.to_dict() for r in requests], qd_runs, config.peer_k,
                                 {v.name: {"method": v.method, "k": v.k} for v in config.variants})}


def counterpart(method: str, k: int, variant_methods: dict[str, dict]) -> str | None:
    """The quickdraft variant a peer method is set beside: same method, K = the peers' K (or the
    nearest K measured)."""
    want = COUNTERPART[method]
    names = [n for n, v in variant_methods.items() if v["method"] == want]
    if not names:
        return None
    return min(names, key=lambda n: abs(variant_methods[n]["k"] - k))


def summarize(methods: list[dict], runs: list[dict], requests: list[dict], qd_runs: list[dict], k: int,
              variant_methods: dict[str, dict]) -> list[dict]:
    """Per peer method x group: tokens/s, speedup over the peer's own plain decoding, quickdraft's
    counterpart beside it and the paired ratio quickdraft / peer; greedy agreement with
    quickdraft's ``none``."""
    qd = {(r["variant"], r["request"]): r for r in qd_runs if r.get("repeat", 0) == 0}
    rows = []
    for dataset, category, ids in groups(requests):
        if category != ALL:
            continue
        for m in methods:
            mine = {r["request"]: r for r in runs if r["name"] == m["name"] and r["request"] in ids}
            plain = {r["request"]: r["tokens_per_second"] for r in runs
                     if r["peer"] == m["peer"] and r["method"] == "plain" and r["request"] in ids}
            if not mine:
                continue
            twin = counterpart(m["method"], k, variant_methods)
            theirs = {q: r["tokens_per_second"] for q, r in mine.items()}
            ours = {q: qd[(twin, q)]["tokens_per_second"] for q in mine if (twin, q) in qd}
            none = {q: qd[("none", q)]["token_ids"] for q in mine if ("none", q) in qd}
            same = [mine[q]["token_ids"] == none[q] for q in none]
            prefix = [_common_prefix(none[q], mine[q]["token_ids"]) for q in none]
            rows.append({
                "name": m["name"], "peer": m["peer"], "method": m["method"], "dataset": dataset, "n": len(mine),
                "tokens_per_second_median": stats.median(list(theirs.values())),
                "ttft_median_s": stats.median([r["ttft_s"] for r in mine.values()]),
                "speedup_over_own_plain": stats.speedup(plain, theirs)["median"],
                "quickdraft_variant": twin,
                "quickdraft_tokens_per_second_median": stats.median(list(ours.values())) if ours else None,
                "quickdraft_over_peer": stats.speedup(theirs, ours)["median"] if ours else None,
                "fraction_identical_to_quickdraft_none": sum(same) / len(same) if same else None,
                # tokens the peer's output shares with quickdraft's none from the start, median over requests
                "identical_prefix_median": stats.median(prefix) if prefix else None,
                "draft_acceptance_rate": _acceptance(list(mine.values())),
            })
    return rows


def _common_prefix(a: list[int], b: list[int]) -> int:
    at = stats.first_divergence(a, b)
    return len(a) if at is None else at


def _acceptance(runs: list[dict]) -> float | None:
    """Accepted over drafted tokens, where the peer counts them (llama-server does)."""
    drafted = sum(r.get("num_draft_tokens") or 0 for r in runs)
    return sum(r.get("num_accepted_tokens") or 0 for r in runs) / drafted if drafted else None


def llama_cpp_best(summary: list[dict]) -> list[dict]:
    """Per data set: "llama.cpp plain" (the fastest plain method of the llama.cpp peers) and
    "llama.cpp best" (the fastest of all their methods: plain, prompt lookup, llama-server's draft
    model and n-gram modes), each a peer summary row, and best over plain."""
    out = []
    for dataset in dict.fromkeys(r["dataset"] for r in summary):
        rows = [r for r in summary if r["dataset"] == dataset and r["peer"] in LLAMA_CPP_PEERS
                and r["tokens_per_second_median"] is not None]
        plain = [r for r in rows if r["method"] == "plain"]
        if not rows:
            continue
        fastest = max(rows, key=lambda r: r["tokens_per_second_median"])
        base = max(plain, key=lambda r: r["tokens_per_second_median"]) if plain else None
        ratio = (fastest["tokens_per_second_median"] / base["tokens_per_second_median"]
                 if base and base["tokens_per_second_median"] else None)
        out.append({"dataset": dataset, "plain": base, "best": fastest, "best_over_plain": ratio})
    return out



if __name__ == "__main__":
    sys.exit(_child())
