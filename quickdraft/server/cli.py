"""``quickdraft serve``'s flags (the model and speculative flags of ``quickdraft generate``, plus
the server's own, named like ``vllm serve``'s, and the Ray Serve ones) and the server they build.
A replica (deploy/: Ray Serve, Triton) parses its flags with ``serve_parser`` or ``args_from_dict``
and imports no command; the ``serve`` command itself is commands/serve.py.

SIGTERM drains: new requests get a 503 (with Retry-After) and ``/health`` a 503 while the
requests in flight run to their end; then the listening socket closes and the process exits with
status 0 (``DrainingServer``). A second SIGINT (Ctrl+C) quits at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys

import uvicorn

from quickdraft.arguments import HelpFormatter, add_model_args, add_switch, resolve_model_args

# With "adaptive": false, speculation turns off for a step with at least this many running
# sequences, unless --speculative-disable-by-batch-size or the JSON key says otherwise (the
# adaptive default plans K per step from measured costs and needs no switch). Measured with
# quickdraft/bench/loadgen.py (docs/benchmarks/archive/serving-concurrency-qwen15) on this 2-core CPU, Qwen2.5-Coder-1.5B
# with the 0.5B draft at K=4: 1.32x plain at 1 stream, 1.06x at 4, 0.81x at 8 (SmolLM2 with ngram:
# 0.92x at 8). 6 sits between the last measured win and the first measured loss.
DEFAULT_DISABLE_BY_BATCH_SIZE = 6


HELP = "an OpenAI-compatible HTTP server (continuous batching, speculative decoding)"


def serve_parser() -> argparse.ArgumentParser:
    """``quickdraft serve``'s parser alone: what a server replica (Ray Serve, Triton) parses its
    arguments with, without building (and importing) the other commands."""
    p = argparse.ArgumentParser(prog="quickdraft serve", description=HELP, formatter_class=HelpFormatter)
    add_serve_args(p)
    return p


def add_serve_args(s: argparse.ArgumentParser) -> None:
    add_model_args(s, positional=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: $QUICKDRAFT_API_KEY)")
    s.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoding at once (KV-cache slots)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a slot; past this a request gets 429 with Retry-After")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients send as 'model' (default: --model)")
    s.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="turn speculation off for a step whose running batch has at least this many sequences "
                        f"(0: never; default: the JSON key, else never when adaptive, else {DEFAULT_DISABLE_BY_BATCH_SIZE})")
    add_switch(s, "--enable-prefix-caching", default=True,
               help="a request (the next chat turn) reuses the KV cache of the longest prefix it shares with "
                    "what the engine holds; outputs are the same either way (default: on)")
    s.add_argument("--max-body-bytes", type=int, default=None,
                   help="the largest request body accepted; a larger one gets 413 (default: 33554432, 32 MiB)")
    s.add_argument("--shutdown-timeout", type=float, default=None,
                   help="on SIGTERM, wait at most this many seconds for requests in flight (default: no limit)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_switch(s, "--access-log", default=True, help="log each HTTP request (uvicorn's access log)")
    add_ray_args(s)


def add_ray_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray Serve (--ray): replicas of this server on a Ray cluster")
    add_switch(g, "--ray", help="serve through Ray Serve: each replica builds its own engine behind Ray's HTTP proxy")
    g.add_argument("--ray-address", default=None,
                   help="the cluster to join (what `ray start --head` prints, or 'auto'); 'local': a new one on "
                        "this machine; default: $RAY_ADDRESS, else a cluster running here, else a new one")
    g.add_argument("--num-replicas", type=int, default=None,
                   help="a fixed number of replicas (default 1, unless --min/--max-replicas autoscale)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling: the fewest replicas (default 1)")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscaling: the most replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling: requests (running and queued) per replica to aim at (default: "
                        "--max-num-seqs / 2)")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves for each replica; torch uses that many threads (default 1)")
    g.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs for each replica (default: 1 with --device cuda*, else 0)")


def ray_only_flags(args: argparse.Namespace) -> list[str]:
    """The Ray flags given a value other than their default (a mistake without --ray)."""
    defaults = {"ray_address": None, "num_replicas": None, "min_replicas": None, "max_replicas": None,
                "target_ongoing_requests": None, "replica_cpus": 1.0, "replica_gpus": None}
    return ["--" + k.replace("_", "-") for k, v in defaults.items() if getattr(args, k) != v]


def speculative_config(args):
    from quickdraft.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(args.speculative_config)
    flag = args.speculative_disable_by_batch_size
    if flag is not None:
        return dataclasses.replace(spec, disable_by_batch_size=flag or None)
    if (spec.enabled and not spec.adaptive and spec.disable_by_batch_size is None
            and not _json_sets_threshold(args.speculative_config)):
        return dataclasses.replace(spec, disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE)
    return spec


def _json_sets_threshold(raw) -> bool:
    import json

    try:
        return isinstance(raw, str) and "disable_by_batch_size" in json.loads(raw)
    except ValueError:
        return False


def build_engine(args, own_thread: bool):
    """The engine and its async bridge from ``quickdraft serve``'s flags; ``own_thread``: the
    engine loop runs in a thread of its own (a Ray Serve replica, a Triton model) rather than on
    the caller's (``quickdraft serve``, see async_engine.py). Returns (AsyncEngine, ServerSettings)."""
    from quickdraft.config import EngineConfig
    from quickdraft.errors import ConfigError
    from quickdraft.llm import build_engine
    from quickdraft.server.app import ServerSettings
    from quickdraft.server.async_engine import AsyncEngine
    from quickdraft.server.metrics import ServerMetrics

    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}", "max_queue")
    from quickdraft.server.limits import DEFAULT_MAX_BODY_BYTES

    max_body = DEFAULT_MAX_BODY_BYTES if args.max_body_bytes is None else args.max_body_bytes
    if max_body < 1:
        raise ConfigError(f"--max-body-bytes must be >= 1, got {max_body}", "max_body_bytes")
    spec = speculative_config(args)
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs, max_queue=args.max_queue, speculative=spec,
                          quantization=args.quantization, enable_prefix_caching=args.enable_prefix_caching,
                          enforce_eager=args.enforce_eager)
    engine, why = build_engine(config)
    print(f"quickdraft: {why}", file=sys.stderr)
    names = args.served_model_name or [args.model]
    k = spec.num_speculative_tokens if spec.enabled else 0
    settings = ServerSettings(served_model_names=names, api_key=args.api_key or os.environ.get("QUICKDRAFT_API_KEY"),
                              spec_method=spec.method, num_speculative_tokens=k, max_body_bytes=max_body)
    return AsyncEngine(engine, ServerMetrics(names[0], k), own_thread=own_thread), settings


def build(args, own_thread: bool):
    """``build_engine``'s pair and the OpenAI app over them: (AsyncEngine, ServerSettings, FastAPI)."""
    from quickdraft.server.app import build_app

    async_engine, settings = build_engine(args, own_thread)
    return async_engine, settings, build_app(async_engine, settings)


def args_from_dict(values: dict, context: str) -> argparse.Namespace:
    """``quickdraft serve``'s flags from a dict whose keys are the flags without their dashes
    (``_`` or ``-`` alike): a switch takes true or false, ``served_model_name`` names separated by
    spaces. Parsed by ``quickdraft serve``'s own parser, so that defaults and checks are the same;
    ``context`` says where the dict came from in the error."""
    import shlex

    from quickdraft.errors import ConfigError

    parser = serve_parser()
    switches = {o for a in parser._actions if isinstance(a, argparse.BooleanOptionalAction) for o in a.option_strings}
    argv = []
    for key, value in values.items():
        flag = "--" + str(key).strip("-").replace("_", "-")
        text = str(value)
        if isinstance(value, bool) or text.lower() in ("true", "false"):
            if text.lower() == "true":
                argv.append(flag)
            elif flag in switches:  # false says the other side: --no-x for x, --x for no-x
                argv.append("--" + flag[5:] if flag.startswith("--no-") else "--no-" + flag[2:])
            continue
        argv += [flag, *shlex.split(text)] if flag == "--served-model-name" else [flag, text]
    try:
        return resolve_model_args(parser.parse_args(argv))
    except SystemExit:  # argparse has printed what is wrong
        raise ConfigError(f"bad quickdraft serve arguments in {context}: {argv}") from None


def run_on_main_thread(server: "DrainingServer", async_engine) -> int:
    """HTTP in a thread, the engine loop here (async_engine.py says why). uvicorn installs no
    signal handlers outside the main thread, so SIGTERM and SIGINT are passed on to it from here:
    the first drains, a second SIGINT quits at once (uvicorn's own rule)."""
    import threading

    def http() -> None:
        try:
            server.run()
        finally:  # a drained shutdown has stopped the loop already; a failed start has not
            async_engine.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: server.handle_exit(signum, frame))
    thread = threading.Thread(target=http, name="quickdraft-http")
    thread.start()
    async_engine.run()
    thread.join()
    return 0 if server.started else 1


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, draining before it closes. On the first SIGTERM (or SIGINT) the app answers
    new requests with a 503 and Retry-After, and ``/health`` with a 503 (``draining``), so that a load
    balancer or Kubernetes stops sending here, while the listening socket stays open and the
    requests in flight run to their end. Once no request is left (or ``--shutdown-timeout`` has
    passed), uvicorn's own shutdown closes the socket and the process exits. A second SIGINT quits
    at once."""

    POLL_S = 0.05

    def __init__(self, config: uvicorn.Config, settings):
        super().__init__(config)
        self.settings = settings

    def handle_exit(self, sig, frame) -> None:
        if self.settings.draining:  # a second signal: uvicorn's rule (SIGINT forces the exit)
            super().handle_exit(sig, frame)
            if sig == signal.SIGINT:
                super().handle_exit(sig, frame)
            return
        self.settings.draining = True
        import threading

        threading.Thread(target=self._drain, name="quickdraft-drain", daemon=True).start()

    def _drain(self) -> None:
        import time

        timeout = self.config.timeout_graceful_shutdown
        deadline = None if timeout is None else time.monotonic() + timeout
        # server_state.tasks: the HTTP requests being answered (503s last a millisecond)
        while self.server_state.tasks and not self.should_exit and (deadline is None or time.monotonic() < deadline):
            time.sleep(self.POLL_S)
        if deadline is not None:  # what is left of the timeout, for uvicorn's own wait
            self.config.timeout_graceful_shutdown = max(0.0, deadline - time.monotonic())
        super().handle_exit(signal.SIGTERM, None)
