"""Peers run in child processes under a time limit: one that segfaults, exits 139, hangs, raises or
is missing becomes a note and a ``peers.status`` entry, and every other figure of the run is kept
(quickdraft's runs, the other peers', and the requests a dying peer finished).

The fake peers below are built in the child from ``"<this module>:<function>"``; the child reads
this process's ``sys.path``, so it imports this file as pytest did."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from quickdraft.bench import peers, schema
from quickdraft.bench.harness import BenchConfig, Request, Variant
from quickdraft.commands.cli import main

HERE = __name__


def _methods(peer: str, k: int, fail_at_call: int | None = None, how: str = "segv") -> list[peers.PeerMethod]:
    """Two fake methods sharing one call counter; call number ``fail_at_call`` (1-based, warm-ups
    included: one per method) segfaults, exits 139 or hangs."""
    calls = [0]

    def generate(ids: list[int]) -> dict:
        calls[0] += 1
        if calls[0] == fail_at_call:
            if how == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            elif how == "exit139":
                os._exit(139)
            elif how == "hang":
                time.sleep(3600)
        start = time.perf_counter()
        return peers._timing([3, 4, 5][: 1 + len(ids) % 3], start, start + 0.001, start + 0.004)

    return [peers.PeerMethod(peer, "plain", {}, generate),
            peers.PeerMethod(peer, "prompt_lookup", {"k": k, "max_ngram_size": 4}, generate)]


def healthy(spec):  # every request
    return _methods("healthy", spec["k"]), {"version": "1.0", "system_info": "AVX2 = 1 | AMX_INT8 = 0"}


def segv_on_second_request(spec):  # 2 warm-ups, request 1 (2 calls), then SIGSEGV on call 5
    return _methods("segv_on_second_request", spec["k"], fail_at_call=5, how="segv"), {}


def exit139_on_first_request(spec):  # as a shell reports a segfault
    return _methods("exit139_on_first_request", spec["k"], fail_at_call=3, how="exit139"), {}


def hang_on_second_request(spec):
    return _methods("hang_on_second_request", spec["k"], fail_at_call=5, how="hang"), {}


def cannot_load(spec):
    raise RuntimeError("unknown GGUF tensor type 99")


FAKES = ["healthy", "segv_on_second_request", "exit139_on_first_request", "hang_on_second_request", "cannot_load"]


@pytest.fixture
def fakes(monkeypatch):
    for name in FAKES:
        monkeypatch.setitem(peers.FACTORIES, name, f"{HERE}:{name}")
    monkeypatch.setitem(peers.MODULES, "ghost", "quickdraft_no_such_module")
    monkeypatch.setattr(peers, "PEERS", (*peers.PEERS, *FAKES, "ghost"))


def test_dead_peers_become_notes_and_the_rest_is_kept(fakes):
    requests = [Request(f"d/{i}#1", "d", "c", str(i), 1, "", [1, 2, 3 + i]) for i in range(2)]
    qd = [{"variant": v, "request": r.id, "repeat": 0, "tokens_per_second": 10.0, "token_ids": [3, 4]}
          for v in ("none", "ngram K=2 n=1..4") for r in requests]
    config = BenchConfig(model="tiny", variants=[Variant("none"), Variant("ngram", 2, 4, 1)], datasets=[],
                         peers=["healthy", "segv_on_second_request", "exit139_on_first_request", "cannot_load",
                                "ghost"], peer_k=2, peer_timeout=120)
    notes: list[str] = []
    out = peers.run_peers(config, "t.gguf", None, {0}, requests, qd, notes, progress=False)
    status = {s["peer"]: s for s in out["status"]}
    assert {p: s["status"] for p, s in status.items()} == {
        "healthy": "ok", "segv_on_second_request": "crashed", "exit139_on_first_request": "crashed",
        "cannot_load": "error", "ghost": "missing"}
    assert status["segv_on_second_request"]["signal"] == signal.SIGSEGV
    assert status["segv_on_second_request"]["exit_code"] == -signal.SIGSEGV
    assert status["exit139_on_first_request"]["signal"] == 11 and status["exit139_on_first_request"]["exit_code"] == 139
    assert status["healthy"]["system"]["system_info"] == "AVX2 = 1 | AMX_INT8 = 0"
    assert any("Segmentation fault" in line or "Fatal Python error" in line
               for line in status["segv_on_second_request"]["stderr_tail"])  # faulthandler's dump

    # the healthy peer's figures in full; the segfaulting one keeps the request it finished
    by_peer = {}
    for r in out["runs"]:
        by_peer.setdefault(r["peer"], set()).add(r["request"])
    assert by_peer == {"healthy": {"d/0#1", "d/1#1"}, "segv_on_second_request": {"d/0#1"}}
    assert (status["segv_on_second_request"]["requests_finished"], status["segv_on_second_request"]["requests_total"]) \
        == (1, 2)
    rows = {r["name"]: r for r in out["summary"]}
    assert rows["healthy plain"]["n"] == 2 and rows["segv_on_second_request plain"]["n"] == 1
    assert not any(name.startswith(("exit139", "cannot_load")) for name in rows)

    text = "\n".join(notes)
    assert "peer segv_on_second_request crashed (signal 11 SIGSEGV, exit -11) after 1 of 2 requests" in text
    assert "peer exit139_on_first_request crashed (signal 11 SIGSEGV, exit 139) after 0 of 2 requests" in text
    assert "its figures are left out" in text
    assert "peer cannot_load skipped: it could not load the model: RuntimeError: unknown GGUF tensor type 99" in text
    assert "peer ghost skipped: not installed" in text
    assert not any("healthy" in n for n in notes)
    assert schema.errors({"methods": [], "runs": [], "summary": [], "status": out["status"]}, schema.PEERS) == []


@pytest.mark.slow
def test_bench_survives_a_segfaulting_and_a_hanging_peer(fakes, smollm2_path, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "--model", "smollm2-135m-instruct", "--methods", "none,ngram",
                 "--num-speculative-tokens-list", "2", "--datasets", "humaneval", "--num-prompts", "2", "--max-tokens", "4",
                 "--warmup-tokens", "2", "--peers", "segv_on_second_request,hang_on_second_request",
                 "--peer-num-speculative-tokens", "2", "--peer-timeout", "20", "--no-progress",
                 "--result-dir", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    schema.validate(result)

    # every figure of quickdraft's own is there
    assert len(result["requests"]) == 2 and len(result["runs"]) == 2 * 2
    assert all(r["num_tokens"] >= 1 for r in result["runs"])
    assert {r["variant"] for r in result["summary"]} == {"none", "ngram K=2 n=2..4"}

    status = {s["peer"]: s for s in result["peers"]["status"]}
    assert status["segv_on_second_request"]["status"] == "crashed"
    assert status["segv_on_second_request"]["signal"] == signal.SIGSEGV
    hung = status["hang_on_second_request"]
    assert hung["status"] == "timed_out" and hung["timeout_s"] == 20 and 20 <= hung["seconds"] < 60
    assert hung["requests_finished"] == 1  # the request before it hung is kept
    assert {r["peer"] for r in result["peers"]["runs"]} == {"segv_on_second_request", "hang_on_second_request"}
    assert len(result["peers"]["runs"]) == 2 * 2  # one request x two methods, each peer

    crash_note = next(n for n in result["notes"] if n.startswith("peer segv_on_second_request crashed"))
    hang_note = next(n for n in result["notes"] if n.startswith("peer hang_on_second_request timed out"))
    assert "signal 11 SIGSEGV" in crash_note and "after 1 of 2 requests" in crash_note
    assert "killed after 20 s (--peer-timeout) after 1 of 2 requests" in hang_note
    md = (out / "report.md").read_text()
    assert crash_note in md and hang_note in md and "## Peers" in md and "crashed (signal 11)" in md
    printed = capsys.readouterr().out
    assert crash_note in printed and hang_note in printed and "timed_out" in printed
    assert "--peer-timeout 20" in result["command"]
