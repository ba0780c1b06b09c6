"""The soak script (``python -m quickdraft.bench.soak``), bounded: 20 s of load with
disconnects and hostile input against the speculating server, run as a user runs it. The
30-minute run and its result are in docs/serving-errors.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from qd_server import ROOT

pytestmark = pytest.mark.slow

DURATION_S = 20


def test_soak_bounded(ngram_server, tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "quickdraft.bench.soak", "--url", ngram_server.url, "--pid", str(ngram_server.proc.pid),
         "--api-key", ngram_server.api_key, "--duration", str(DURATION_S), "--concurrency", "3", "--max-tokens", "24",
         "--out", str(out), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    print("\n" + proc.stdout)
    assert r["ok"] and r["failures"] == {} and r["greedy_deterministic"]
    assert r["health"]["before"]["status"] == r["health"]["after"]["status"] == "ok"
    assert r["health"]["after"]["running"] == r["health"]["after"]["waiting"] == 0  # the cut requests' slots freed
    assert r["requests_finished"] > 0 and sum(r["disconnects"].values()) > 0 and r["hostile_as_expected"] > 0
    assert all(int(key.split()[-1]) < 500 for key in r["statuses"])
    assert {"body-over-the-limit-declared", "deep-body", "surrogate-content", "long-tokenize"} <= set(r["hostile_by_case"])
    assert r["rss_mib"]["before"] and r["rss_mib"]["peak"] >= r["rss_mib"]["after"] > 0
