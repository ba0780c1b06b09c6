"""quickdraft on Ray Serve, on a local Ray cluster on this machine (``--ray-address local``).

The flags' mapping onto Ray's deployment options is checked without Ray running. The end-to-end
test starts ``quickdraft serve --ray`` with 2 replicas of SmolLM2-135M (float32, ngram K=4) behind
Ray's HTTP proxy on loopback and sends 32 greedy requests with the real openai client, 8 at a
time. After the 8th answer it kills one replica (SIGKILL). What happens, and is asserted:

* the requests that replica was running fail at Ray's proxy with a 500 (``text/plain``, "Internal
  Server Error": Ray's own body, not OpenAI's JSON); the openai client retries a 500 (its default
  is 2 retries), so every one of the 32 requests is answered, each equal token for token to
  ``LLM.generate`` without speculation;
* Ray's controller starts a new replica (the server logs ``replicas: 2 RUNNING`` again), and the
  new replica serves requests.

A stream cut by the kill cannot be retried by the client (``APIConnectionError`` mid-stream); the
README says so. Lean for CI: 1 CPU and 1 torch thread per replica, a 128 MiB object store, no
dashboard, 12 tokens a request.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from quickdraft.commands.cli import build_parser
from quickdraft.deploy.ray_serve import deployment_options, parse_builder_args
from quickdraft.errors import ConfigError

MODEL = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[2]
NUM_REQUESTS, CONCURRENCY, KILL_AFTER, MAX_TOKENS = 32, 8, 8, 12
PROMPTS = [f"{w} number {i}:" for i in range(4) for w in
           ("The capital of France is", "def fibonacci(n):", "Here is a list of fruits:", "1, 2, 3, 4,",
            "Once upon a time", "import numpy as np", "The quick brown fox", "To make a cup of tea,")]


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--ray", *argv])


# -- the flags -> Ray's options (no Ray cluster) ---------------------------------------------
def test_options_tie_ongoing_requests_to_slots_and_queue_to_backpressure():
    opts = deployment_options(_serve_args("--max-num-seqs", "6", "--max-queue", "10", "--num-replicas", "3",
                                          "--replica-cpus", "2", "--shutdown-timeout", "30"))
    assert opts["max_ongoing_requests"] == 6 and opts["num_replicas"] == 3
    assert opts["max_queued_requests"] == 10 and opts["backpressure_config"]["status_code"] == 429
    assert opts["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0}
    assert opts["graceful_shutdown_timeout_s"] == 30 and "autoscaling_config" not in opts


def test_autoscaling_from_the_serve_flags():
    opts = deployment_options(_serve_args("--max-num-seqs", "8", "--min-replicas", "1", "--max-replicas", "4"))
    assert opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                          "target_ongoing_requests": 4.0}  # half the slots
    assert "num_replicas" not in opts
    opts = deployment_options(_serve_args("--max-replicas", "3", "--target-ongoing-requests", "2.5",
                                          "--device", "cuda:0"))
    assert opts["autoscaling_config"]["target_ongoing_requests"] == 2.5
    assert opts["ray_actor_options"]["num_gpus"] == 1


@pytest.mark.parametrize("argv, param", [
    (("--num-replicas", "2", "--max-replicas", "3"), "num_replicas"),
    (("--min-replicas", "3", "--max-replicas", "2"), "min_replicas"),
    (("--num-replicas", "0"), "num_replicas"),
    (("--target-ongoing-requests", "0"), "target_ongoing_requests"),
    (("--replica-cpus", "0"), "replica_cpus"),
])
def test_contradictory_flags_are_a_clear_error(argv, param):
    with pytest.raises(ConfigError) as e:
        deployment_options(_serve_args(*argv))
    assert e.value.param == param


def test_ray_flags_without_ray_are_a_clear_error(capsys):
    from quickdraft.commands.cli import main

    assert main(["serve", "--num-replicas", "2", "--replica-cpus", "2"]) == 2  # before any model loads
    assert "--num-replicas, --replica-cpus place Ray Serve replicas: add --ray" in capsys.readouterr().err


def test_serve_run_builder_args_are_the_serve_flags():
    args = parse_builder_args({"model": MODEL, "max_num_seqs": "4", "num-replicas": "2", "no_access_log": "true",
                               "served_model_name": "a b", "speculative_config": '{"method": "ngram"}'})
    assert (args.model, args.max_num_seqs, args.num_replicas, args.access_log) == (MODEL, 4, 2, False)
    assert args.served_model_name == ["a", "b"] and args.speculative_config == '{"method": "ngram"}'
    with pytest.raises(ConfigError, match="bad quickdraft serve arguments in the Ray Serve"):
        parse_builder_args({"max_num_seqs": "many"})


# -- 2 replicas behind Ray's proxy -----------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayServer:
    """``quickdraft serve --ray`` on a new local cluster; its log says when replicas change."""

    def __init__(self, tmp: Path, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "ray-serve.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        cmd = [sys.executable, "-m", "quickdraft", "serve", "--ray", "--ray-address", "local", "--model", MODEL,
               "--dtype", "float32", "--max-model-len", "256", "--port", str(self.port), "--no-access-log",
               "--log-level", "info", *extra]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, after: int = 0, timeout: float = 240) -> int:
        """Wait until the log, past character ``after``, matches; returns where the match ends."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"quickdraft serve --ray exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            m = re.search(pattern, self.log()[after:])
            if m:
                return after + m.end()
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in the log after {timeout}s:\n{self.log()[-4000:]}")

    def replicas(self) -> list[psutil.Process]:
        """The replica processes of this server's cluster (its raylet is a child of the server)."""
        kids = psutil.Process(self.proc.pid).children(recursive=True)
        return [p for p in kids if "ServeReplica" in " ".join(_cmdline(p))]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory, smollm2_path):
    server = RayServer(tmp_path_factory.mktemp("ray"), "--num-replicas", "2", "--replica-cpus", "1",
                       "--max-num-seqs", "4", "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}')
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(ray_server):
    """LLM.generate, without speculation, computed while the replicas start."""
    from quickdraft import LLM, SamplingParams

    with LLM(MODEL, dtype="float32", max_model_len=256, max_num_seqs=8) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [(o.text, o.token_ids) for o in outs]


@pytest.mark.slow
def test_two_replicas_answer_everything_through_a_replica_kill(ray_server, reference):
    server = ray_server
    up = server.wait_for(r"replicas: 2 RUNNING")
    statuses: list[int] = []
    http = httpx.Client(timeout=120, event_hooks={"response": [lambda r: statuses.append(r.status_code)]})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=4, http_client=http)

    def complete(i: int):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
        return r.choices[0].text, r.choices[0].model_extra["token_ids"]

    victim = server.replicas()[0]
    with cf.ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(complete, i) for i in range(NUM_REQUESTS)]
        done = 0
        for f in cf.as_completed(futures):
            done += 1
            if done == KILL_AFTER:  # 8 requests in flight, at most 4 on each replica
                victim.kill()
        answers = [f.result() for f in futures]

    assert answers == reference  # every request answered, token for token LLM.generate's
    assert 500 in statuses, "the kill hit no request in flight"
    assert set(statuses) <= {200, 500}, statuses  # Ray's proxy: a 500 for a replica that died; retried
    print(f"{statuses.count(500)} of {NUM_REQUESTS} requests failed with 500 on the killed replica and were retried")

    # Ray replaces the replica; the new one serves.
    server.wait_for(r"replicas: 1 RUNNING, 1 STARTING|replicas: 1 STARTING, 1 RUNNING", after=up, timeout=30)
    server.wait_for(r"replicas: 2 RUNNING", after=up, timeout=120)
    fresh = [p for p in server.replicas() if p.pid != victim.pid]
    assert len(fresh) == 2
    new = max(fresh, key=lambda p: p.create_time())
    before = sum(new.cpu_times()[:2])
    with cf.ThreadPoolExecutor(CONCURRENCY) as pool:  # 8 at once: more than one replica's 4 slots
        # three rounds: one round's share of a replica came out at 0.25 s of CPU, on the threshold
        again = list(pool.map(complete, [i % CONCURRENCY for i in range(3 * CONCURRENCY)]))
    assert again == reference[:CONCURRENCY] * 3
    assert sum(new.cpu_times()[:2]) - before > 0.25, "the new replica served nothing"
    assert server.stop() == 0, server.log()[-4000:]
