"""The llama_server peer: llama-server's command lines, requests and answers, its lifecycle (against a
stand-in server written in Python, so no build is needed), "llama.cpp plain" and "llama.cpp best" in
the report's tables, and one run of the real binary when ``make llama-server`` has built it."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from quickdraft.bench import llama_server as ls
from quickdraft.bench import peers, report


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


# -- command lines -------------------------------------------------------------------------------

def test_modes_plain_draft_and_ngram(tmp_path):
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    got = {m.method: m for m in ls.modes(str(draft), 4, 3)}
    assert list(got) == ["plain", "draft", "ngram_simple", "ngram_map_k", "ngram_mod", "ngram_cache"]
    assert got["plain"].flags == ()
    d = list(got["draft"].flags)
    assert _flag(d, "-md") == str(draft) and _flag(d, "--spec-type") == "draft-simple"
    assert _flag(d, "--spec-draft-n-max") == "4" and _flag(d, "--spec-draft-n-min") == "0" and _flag(d, "-ngld") == "0"
    s = list(got["ngram_simple"].flags)
    assert _flag(s, "--spec-ngram-simple-size-n") == "3" and _flag(s, "--spec-ngram-simple-size-m") == "4"
    m = list(got["ngram_mod"].flags)
    assert _flag(m, "--spec-ngram-mod-n-match") == "3" and _flag(m, "--spec-ngram-mod-n-max") == "4"
    assert got["ngram_cache"].settings == {"k": ls.NGRAM_CACHE_DRAFT}
    # every method has a quickdraft counterpart
    assert all(peers.COUNTERPART[name] for name in got)


def test_no_draft_mode_without_a_gguf_draft(tmp_path):
    assert "draft" not in {m.method for m in ls.modes(None, 4, 4)}
    assert "draft" not in {m.method for m in ls.modes(str(tmp_path), 4, 4)}  # a Hugging Face directory


def test_command_line(tmp_path):
    draft = tmp_path / "d.gguf"
    draft.write_bytes(b"GGUF")
    plain, with_draft = ls.modes(str(draft), 2, 4)[:2]
    cmd = ls.command("/bin/llama-server", "/m/t.gguf", plain, 3, 2048, 5555)
    assert cmd[0] == "/bin/llama-server" and _flag(cmd, "-m") == "/m/t.gguf"
    assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--port") == "5555"
    assert _flag(cmd, "-c") == "2048" and _flag(cmd, "-np") == "1"
    assert _flag(cmd, "-t") == _flag(cmd, "-tb") == "3"
    assert "--spec-type" not in cmd and "-td" not in cmd
    cmd = ls.command("/bin/llama-server", "/m/t.gguf", with_draft, 3, 2048, 5555)
    assert _flag(cmd, "-td") == _flag(cmd, "-tbd") == "3" and _flag(cmd, "-md") == str(draft)
    # N slots at a time (-np): each keeps the whole context, and -c is all of theirs together
    cmd = ls.command("/bin/llama-server", "/m/t.gguf", plain, 3, 2048, 5555, slots=4)
    assert _flag(cmd, "-np") == "4" and _flag(cmd, "-c") == str(4 * 2048)


def test_request_body_is_greedy_token_ids_without_prompt_reuse():
    body = ls.request_body([1, 2, 3], 16, False)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16
    assert body["temperature"] == 0.0 and body["top_k"] == 1 and body["repeat_penalty"] == 1.0
    assert body["cache_prompt"] is False and body["return_tokens"] is True and body["stream"] is False
    assert body["ignore_eos"] is False and ls.request_body([1], 4, True)["ignore_eos"] is True
    json.dumps(body)


# -- answers -------------------------------------------------------------------------------------

def test_parse_response_cuts_at_eos_and_times_as_quickdraft_does():
    resp = {"tokens": [5, 6, 7, 2, 9], "stop_type": "eos",
            "timings": {"prompt_n": 10, "cache_n": 0, "prompt_ms": 50.0, "predicted_n": 4, "predicted_ms": 200.0,
                        "predicted_per_second": 15.0, "draft_n": 6, "draft_n_accepted": 3}}
    run = ls.parse_response(resp, {2}, 128, 0.3)
    assert run["token_ids"] == [5, 6, 7] and run["num_tokens"] == 3
    assert run["ttft_s"] == pytest.approx(0.05) and run["seconds"] == pytest.approx(0.2)
    assert run["tokens_per_second"] == pytest.approx(2 / 0.2)  # the tokens after the first over first -> last
    assert run["server_tokens_per_second"] == 15.0 and run["total_seconds"] == 0.3
    assert (run["num_draft_tokens"], run["num_accepted_tokens"]) == (6, 3)
    assert run["num_prompt_tokens_computed"] == 10 and run["num_prompt_tokens_cached"] == 0
    assert ls.parse_response(resp, set(), 2, 0.3)["token_ids"] == [5, 6]  # at most max_tokens


def test_parse_response_without_tokens_or_timings_is_an_error():
    with pytest.raises(ValueError, match="tokens"):
        ls.parse_response({"content": "x", "timings": {}}, set(), 8, 0.1)
    with pytest.raises(ValueError, match="timings"):
        ls.parse_response({"tokens": [1]}, set(), 8, 0.1)


def test_system_info_features():
    line = "n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 | AMX_INT8 = 0 | "
    assert ls.parse_system_info(line) == {"SSE3": 1, "AVX2": 1, "AVX512": 0, "AMX_INT8": 0}


def test_binary_is_found_in_the_cache_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ls.BINARY_ENV, raising=False)
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path))
    monkeypatch.setenv("QUICKDRAFT_ISA", "avx2")
    assert ls.binary() is None and not peers._installed("llama_server")
    exe = tmp_path / "llama-server" / "avx2" / "bin" / "llama-server"
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    assert ls.binary() == exe and peers._installed("llama_server")
    monkeypatch.delenv("QUICKDRAFT_ISA")
    assert ls.binary() is None  # native's is another build
    monkeypatch.setenv(ls.BINARY_ENV, str(exe))
    assert ls.binary() == exe
    monkeypatch.setenv(ls.BINARY_ENV, str(tmp_path / "nothing"))
    assert ls.binary() is None


# -- the lifecycle, against a stand-in --------------------------------------------------------------

FAKE = """\
#!{python}
# a stand-in llama-server: /health, and /completion echoing the prompt's last token + 1, +2, ...
import json, sys, http.server
args = sys.argv[1:]
if "--version" in args:
    print("version: 1 (fake)"); sys.exit(0)
port = int(args[args.index("--port") + 1])
draft = "--spec-type" in args
print("system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 0 | ", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send(200, {{"status": "ok"}})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["cache_prompt"] is False and body["return_tokens"] is True
        n, last = body["n_predict"], body["prompt"][-1]
        timings = {{"prompt_n": len(body["prompt"]), "cache_n": 0, "prompt_ms": 10.0, "predicted_n": n,
                   "predicted_ms": 100.0, "predicted_per_second": (n - 1) / 0.1}}
        if draft:
            timings.update(draft_n=n, draft_n_accepted=n // 2)
        self._send(200, {{"tokens": [last + 1 + i for i in range(n)], "timings": timings, "stop_type": "limit"}})
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    exe = tmp_path / "llama-server"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(ls.BINARY_ENV, str(exe))
    return exe


def test_peer_starts_a_server_a_mode_and_closes_them(fake_server, tmp_path):
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    spec = {"target": str(target), "draft": str(draft), "k": 3, "lookup_max": 4, "max_tokens": 5, "eos": [],
            "ignore_eos": False, "threads": 2, "n_ctx": 512}
    methods, servers = ls.llama_server_methods(fake_server, **{k: v for k, v in spec.items() if k != "eos"},
                                               eos={9})
    try:
        assert [m.name for m in methods] == ["llama_server plain", "llama_server draft K=3",
                                             "llama_server ngram_simple K=3", "llama_server ngram_map_k K=3",
                                             "llama_server ngram_mod K=3", "llama_server ngram_cache K=8"]
        assert len({s.port for s in servers}) == len(servers)
        run = methods[0].generate([1, 2, 3])
        assert run["token_ids"] == [4, 5, 6, 7, 8]
        assert run["tokens_per_second"] == pytest.approx(40.0) and run["ttft_s"] == pytest.approx(0.01)
        run = methods[1].generate([1, 2, 6])  # 9 is end-of-sequence
        assert run["token_ids"] == [7, 8] and run["num_draft_tokens"] == 5
    finally:
        for s in servers:
            s.close()
    assert all(s.proc.poll() is not None for s in servers)


def test_peer_in_its_child_process_reports_its_build(fake_server, tmp_path):
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    spec = {"factory": peers.FACTORIES["llama_server"], "target": str(target), "draft": None, "k": 2,
            "lookup_max": 4, "max_tokens": 4, "eos": [], "ignore_eos": False, "threads": 2, "n_ctx": 512,
            "sys_path": [p for p in sys.path if p],
            "requests": [{"id": f"d/{i}#1", "prompt_token_ids": [1, 2, 3 + i]} for i in range(2)]}
    status = peers.run_child("llama_server", spec, 120)
    assert status["status"] == "ok", status
    assert status["requests_finished"] == 2 and len(status["runs"]) == 2 * 5  # no draft mode: no draft given
    system = status["system"]
    assert system["version"].startswith("version: 1 (fake)") and system["features"]["AVX512"] == 1
    assert set(system["commands"]) == {"plain", "ngram_simple", "ngram_map_k", "ngram_mod", "ngram_cache"}


def test_a_server_that_cannot_start_says_why(tmp_path):
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\nimport sys\nprint('error: invalid argument: --spec-type'); sys.exit(1)\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    server = ls.Server([str(exe)], ls.free_port(), "plain")
    with pytest.raises(RuntimeError, match="invalid argument"):
        server.wait_ready(timeout=30)
    server.close()


# -- llama.cpp plain and best in the report ------------------------------------------------------

def test_summary_sets_each_mode_beside_its_quickdraft_twin():
    methods = [{"name": "llama_server plain", "peer": "llama_server", "method": "plain"},
               {"name": "llama_server draft K=4", "peer": "llama_server", "method": "draft"},
               {"name": "llama_server ngram_mod K=4", "peer": "llama_server", "method": "ngram_mod"}]
    q = "d/1#1"
    run = {"request": q, "peer": "llama_server", "ttft_s": 0.1}
    runs = [{**run, "name": methods[0]["name"], "method": "plain", "tokens_per_second": 10.0, "token_ids": [1, 2, 3]},
            {**run, "name": methods[1]["name"], "method": "draft", "tokens_per_second": 15.0, "token_ids": [1, 2, 9],
             "num_draft_tokens": 4, "num_accepted_tokens": 2},
            {**run, "name": methods[2]["name"], "method": "ngram_mod", "tokens_per_second": 11.0,
             "token_ids": [1, 2, 3], "num_draft_tokens": 0, "num_accepted_tokens": 0}]
    qd = [{"variant": v, "request": q, "repeat": 0, "tokens_per_second": tps, "token_ids": [1, 2, 3]}
          for v, tps in (("none", 12.0), ("draft_model K=4", 20.0), ("ngram K=4 n=2..4", 13.0))]
    variants = {"none": {"method": "none", "k": 0}, "draft_model K=4": {"method": "draft_model", "k": 4},
                "ngram K=4 n=2..4": {"method": "ngram", "k": 4}}
    rows = {r["name"]: r for r in peers.summarize(methods, runs, [{"id": q, "dataset": "d", "category": "c"}], qd, 4,
                                                  variants)}
    plain, draft, mod = (rows[m["name"]] for m in methods)
    assert plain["quickdraft_variant"] == "none" and plain["identical_prefix_median"] == 3
    assert plain["fraction_identical_to_quickdraft_none"] == 1.0 and plain["draft_acceptance_rate"] is None
    assert draft["quickdraft_variant"] == "draft_model K=4" and draft["quickdraft_over_peer"] == pytest.approx(20 / 15)
    assert draft["speedup_over_own_plain"] == pytest.approx(1.5) and draft["draft_acceptance_rate"] == 0.5
    assert draft["identical_prefix_median"] == 2 and draft["fraction_identical_to_quickdraft_none"] == 0.0
    assert mod["quickdraft_variant"] == "ngram K=4 n=2..4" and mod["draft_acceptance_rate"] is None


def _peer_row(name, peer, method, dataset, tps):
    return {"name": name, "peer": peer, "method": method, "dataset": dataset, "n": 2,
            "tokens_per_second_median": tps, "ttft_median_s": 0.1, "speedup_over_own_plain": 1.0,
            "quickdraft_variant": "none", "quickdraft_tokens_per_second_median": 30.0, "quickdraft_over_peer": 1.0,
            "fraction_identical_to_quickdraft_none": 1.0, "draft_acceptance_rate": None}


def _summary_row(variant, method, dataset, tps, speedup):
    return {"variant": variant, "method": method, "dataset": dataset, "category": "all",
            "tokens_per_second_median": tps, "speedup": {"median": speedup}, "mean_accepted_length": 2.0}


def test_llama_cpp_plain_and_best_side_by_side():
    summary = [_peer_row("transformers plain", "transformers", "plain", "all", 50.0),
               _peer_row("llama_cpp plain", "llama_cpp", "plain", "all", 20.0),
               _peer_row("llama_cpp prompt_lookup K=4", "llama_cpp", "prompt_lookup", "all", 15.0),
               _peer_row("llama_server plain", "llama_server", "plain", "all", 22.0),
               _peer_row("llama_server draft K=4", "llama_server", "draft", "all", 33.0)]
    (b,) = peers.llama_cpp_best(summary)
    assert b["plain"]["name"] == "llama_server plain" and b["best"]["name"] == "llama_server draft K=4"
    assert b["best_over_plain"] == pytest.approx(1.5)
    result = {"summary": [_summary_row("none", "none", "all", 30.0, 1.0),
                          _summary_row("draft_model K=4", "draft_model", "all", 44.0, 1.4)],
              "peers": {"summary": summary}}
    names = [r[0] for r in report.peer_rows(result["peers"])]
    assert names[-2:] == ["llama.cpp plain = llama_server plain", "llama.cpp best = llama_server draft K=4"]
    (row,) = report.llama_rows(result)
    assert row[1:6] == ["llama_server plain", "22.00", "llama_server draft K=4", "33.00", "1.50x"]
    assert row[6:] == ["draft_model K=4", "44.00", "2.00x", "1.33x"]
    line = next(x for x in report.headline(result) if x.startswith("llama.cpp plain"))
    assert "llama.cpp best: 33.00 tok/s (llama_server draft K=4, 1.50x its plain)" in line and line.endswith("1.33x")


def test_without_llama_cpp_peers_there_is_no_llama_cpp_table():
    summary = [_peer_row("transformers plain", "transformers", "plain", "all", 50.0)]
    assert peers.llama_cpp_best(summary) == []
    assert report.llama_rows({"summary": [], "peers": {"summary": summary}}) == []


# -- the real binary -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(ls.binary() is None,
                    reason="no llama-server binary: `make llama-server` builds it (or set $QUICKDRAFT_LLAMA_SERVER)")
def test_real_llama_server_decodes_as_its_plain_self(smollm2_path):
    """SmolLM2-135M as target and as its own draft: every mode answers, the draft is all accepted,
    and each mode's greedy tokens start as plain decoding's."""
    methods, servers = ls.llama_server_methods(ls.binary(), str(smollm2_path), str(smollm2_path), 2, 3, 12, set(),
                                               True, min(2, os.cpu_count() or 1), 512)
    try:
        ids = [1, 504, 3280, 314, 253, 1789, 28, 198]
        runs = {m.method: m.generate(ids) for m in methods}
    finally:
        for s in servers:
            s.close()
    assert set(runs) == {"plain", "draft", "ngram_simple", "ngram_map_k", "ngram_mod", "ngram_cache"}
    plain = runs["plain"]["token_ids"]
    assert len(plain) == 12 and runs["plain"]["tokens_per_second"] > 0
    for method, run in runs.items():
        assert run["num_tokens"] == 12 and run["num_prompt_tokens_cached"] == 0, method
        assert run["token_ids"][:4] == plain[:4], method
    assert runs["draft"]["num_draft_tokens"] > 0
    assert runs["draft"]["num_accepted_tokens"] == runs["draft"]["num_draft_tokens"]  # its own draft
