"""A tiny ``quickdraft bench`` on SmolLM2-135M: it writes results.json (schema-checked), report.md
and the plots; greedy ngram output equals none's; temperature > 0 yields TV tests; the peers run
beside quickdraft when installed."""

from __future__ import annotations

import importlib.util
import json

import pytest

from quickdraft.bench import schema
from quickdraft.bench.harness import BenchConfig, Harness, variants
from quickdraft.commands.cli import main

pytestmark = pytest.mark.slow
PNG = b"\x89PNG\r\n\x1a\n"


def bench(tmp_path, *extra) -> dict:
    out = tmp_path / "out"
    # dequantized: there the adaptive plan drafts on this tiny model (on its blocks a pass is so
    # cheap that it may plan K=0, and the acceptance plot would have nothing to show)
    # n=1..4: a match of one token is all but certain in 8 tokens of any output (with n=2..4 whether
    # ngram drafts at all hangs on what the model happens to write)
    argv = ["bench", "--model", "smollm2-135m-instruct", "--methods", "none,ngram", "--num-speculative-tokens-list", "2",
            "--prompt-lookup-min", "1", "--peers", "none", "--warmup-tokens", "2", "--no-progress", "--quantization", "none", "--result-dir", str(out), *extra]
    assert main(argv) == 0
    return json.loads((out / "results.json").read_text())


def test_tiny_greedy_bench_writes_all_outputs(smollm2_path, tmp_path, capsys):
    result = bench(tmp_path, "--datasets", "humaneval,mtbench", "--num-prompts", "1", "--max-tokens", "8")
    out = tmp_path / "out"
    schema.validate(result)
    assert schema.errors(result, schema.SCHEMA) == []  # the small checker too, whether jsonschema is there or not
    for name in ("speedup_by_category.png", "acceptance_by_position.png", "tokens_per_second_vs_k.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert any("quickdraft_vs_peers.png" in n for n in result["notes"])  # no peers: said, not drawn

    # one HumanEval prompt and MT-Bench's two turns; the second asked after none's first answer
    ids = [r["id"] for r in result["requests"]]
    assert ids == ["humaneval/HumanEval/0#1", "mtbench/81#1", "mtbench/81#2"]
    first = next(r for r in result["runs"] if r["variant"] == "none" and r["request"] == "mtbench/81#1")
    second = next(r for r in result["requests"] if r["id"] == "mtbench/81#2")
    assert first["text"].strip() in second["prompt_text"]
    assert len(result["runs"]) == 3 * 2 and all(r["num_tokens"] >= 1 for r in result["runs"])

    rows = {(r["variant"], r["dataset"], r["category"]): r for r in result["summary"]}
    assert set(rows) == {(v, d, c) for v in ("none", "ngram K=2 n=1..4")
                         for d, c in (("humaneval", "coding"), ("humaneval", "all"), ("mtbench", "writing"),
                                      ("mtbench", "all"), ("all", "all"))}
    top = rows[("ngram K=2 n=1..4", "all", "all")]
    assert top["lossless"]["fraction_identical"] == 1.0 and top["lossless"]["num_divergences"] == 0
    assert top["speedup"]["n"] == 3 and top["tokens_per_second_median"] > 0
    assert len(top["acceptance_by_position"]) <= 2
    assert rows[("none", "all", "all")]["speedup"]["median"] == 1.0
    assert result["floor"]["floor_tokens_per_second"] > 0 and result["floor"]["fraction_of_floor"] > 0
    assert result["command"].startswith("quickdraft bench --model smollm2-135m-instruct")

    md = (out / "report.md").read_text()
    assert "## Summary" in md and "## By category" in md and "ngram K=2 n=1..4" in md and "![speedup]" in md
    printed = capsys.readouterr().out
    assert "tok/s med" in printed and "floor:" in printed


def test_tiny_sampled_bench_compares_distributions(smollm2_path, tmp_path):
    result = bench(tmp_path, "--datasets", "humaneval", "--num-prompts", "1", "--max-tokens", "4",
                   "--temperature", "0.8", "--num-seeds", "3")
    schema.validate(result)
    assert len(result["runs"]) == 2 * 3 and {r["seed"] for r in result["runs"]} == {0, 1, 2}
    (test,) = result["tv_tests"]
    assert test["n_a"] == test["n_b"] == 3 and len(test["per_position"]) == 4
    row = next(r for r in result["summary"] if r["variant"] != "none" and r["category"] == "all")
    assert row["lossless"]["kind"] == "tv" and 0 <= row["lossless"]["tv"] <= 1
    assert row["speedup"]["n"] == 3  # paired by request and seed


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_peers_run_beside_quickdraft(smollm2_path):
    names = ["transformers"] + (["llama_cpp"] if importlib.util.find_spec("llama_cpp") else [])
    config = BenchConfig(model="smollm2-135m-instruct", variants=variants(["ngram"], [2], None, [4], [1]),
                         datasets=["humaneval"], limit=1, max_tokens=6, warmup_tokens=2, peers=names, peer_k=2)
    result = Harness(config, progress=False).run()
    got = {r["name"] for r in result["peers"]["summary"]}
    assert {"transformers plain", "transformers prompt_lookup K=2"} <= got
    if "llama_cpp" in names:
        assert {"llama_cpp plain", "llama_cpp prompt_lookup K=2"} <= got
    for row in result["peers"]["summary"]:
        assert row["tokens_per_second_median"] > 0 and row["quickdraft_over_peer"] > 0
        assert row["quickdraft_variant"] == ("none" if row["method"] == "plain" else "ngram K=2 n=1..4")
    assert all(1 <= r["num_tokens"] <= 6 for r in result["peers"]["runs"])
    # each ran in its own process, to the end, and says what it was
    status = {s["peer"]: s for s in result["peers"]["status"]}
    assert {p: s["status"] for p, s in status.items()} == {p: "ok" for p in names}
    assert all(s["requests_finished"] == s["requests_total"] == 1 for s in status.values())
    assert status["transformers"]["system"]["version"]
    if "llama_cpp" in names:  # ggml's system info: the instruction sets the build uses
        assert "AVX2" in status["llama_cpp"]["system"]["features"]
