"""``quickdraft serve`` as a separate process on 127.0.0.1 with a free port, SmolLM2-135M-Instruct
in float32 (greedy equality is exact there), and what the tests read from it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m-instruct"
API_KEY = "test-key"
MAX_MODEL_LEN = 512
EDGE_MAX_BODY = 8_000_000  # edge_server's --max-body-bytes: above the 5 MB prompt, which the prompt bound refuses
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *extra: str, api_key: str | None = API_KEY, log_name: str = "server"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        args = [sys.executable, "-m", "quickdraft", "serve", "--model", MODEL, "--dtype", "float32",
                "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(MAX_MODEL_LEN),
                "--no-access-log", "--log-level", "warning", *extra]
        if api_key:
            args += ["--api-key", api_key]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("QUICKDRAFT_API_KEY", None)
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"qd-{log_name}-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def metrics(self) -> dict[tuple, float]:
        """{(sample name, sorted label items without model_name): value} from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)  # a busy machine drains and saves slowly
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
