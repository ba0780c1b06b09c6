"""The harness's pieces that need no real weights: variants, flags, the divergence margin (on a
tiny random model), peer skipping, the peers' summary pairing."""

from __future__ import annotations

import argparse

import pytest

from quickdraft.bench import cli as bench_cli
from quickdraft.bench import peers
from quickdraft.bench.harness import BenchConfig, Harness, Request, Variant, variants
from quickdraft.config import EngineConfig
from quickdraft.engine.engine import Engine
from quickdraft.errors import ConfigError
from quickdraft.evaluation.measure import top2_margin
from quickdraft.models.decoder import Decoder
from quickdraft.models.loader import LoadedModel
from quickdraft.models.tiny import random_weights, tiny_config
from quickdraft.sampling import SamplingParams

CONFIG = tiny_config("qwen2", vocab_size=96, hidden_size=64, num_layers=2)
TINY = LoadedModel(CONFIG, random_weights(CONFIG, seed=1, scale=2.0), None, "tiny")


def test_variants_are_every_combination_with_none_first():
    vs = variants(["ngram", "draft_model"], [2, 4], "d", lookup_max=[3, 4], lookup_min=[1, 4])
    names = [v.name for v in vs]
    assert names[0] == "none"
    assert "ngram K=2 n=1..3" in names and "ngram K=4 n=4..4" in names
    assert "ngram K=2 n=4..3" not in names  # min > max is no setting
    assert names.count("draft_model K=4") == 1
    assert len(vs) == 1 + 2 * 3 + 2
    assert Variant("ngram", 2, 4, 1).spec(None) == {"method": "ngram", "num_speculative_tokens": 2, "adaptive": True,
                                                    "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    both = variants(["draft_model"], [4], "d", [4], [2], adaptive=(True, False))
    assert [v.name for v in both] == ["none", "draft_model K=4", "draft_model K=4 fixed"]
    assert both[2].spec("d")["adaptive"] is False


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_speculative_config_variant_keeps_its_other_keys():
    """--speculative-config adds one variant; the keys a Variant has no field for travel in its
    options, into its name and its spec, so two settings of a draft are told apart."""
    args = _args(suite="quick", speculative_config='{"method": "draft_model", "model": "d", "quantization": "q4_0", '
                                                   '"draft_vocab_size": 32768}')
    c = bench_cli.build_config(bench_cli.resolve(args), args)
    v = c.variants[-1]
    # the suite's own draft is another model: each draft_model variant is named by its draft
    assert v.name == "draft_model K=4 model=d draft_vocab_size=32768 quantization=q4_0" and v.draft == "d"
    assert v.spec("loaded") == {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": True, "model": "loaded",
                                "draft_vocab_size": 32768, "quantization": "q4_0"}
    assert "draft_model K=4 model=qwen2.5-coder-0.5b-instruct" in [x.name for x in c.variants]  # the suite's own
    two = _args(suite="quick", speculative_config='[{"method": "draft_model", "model": "d", "quantization": "q4_0"}, '
                                                  '{"method": "suffix", "num_speculative_tokens": 6}]')
    names = [x.name for x in bench_cli.build_config(bench_cli.resolve(two), two).variants]
    assert names[-2:] == ["draft_model K=4 model=d quantization=q4_0", "suffix K=6"]
    # a trained head's directory is no draft to load: it reaches the engine in the spec as given
    head = _args(suite="quick", speculative_config='{"method": "eagle3", "model": "/cache/heads/t/eagle3-generated"}')
    v = bench_cli.build_config(bench_cli.resolve(head), head).variants[-1]
    assert v.draft is None and v.name == "eagle3 K=4 model=eagle3-generated"
    assert v.spec(None)["model"] == "/cache/heads/t/eagle3-generated"
    for bad in ('[{"method": "ngram"}, 3]', "{not json"):
        with pytest.raises(ConfigError, match="speculative-config"):
            bad_args = _args(suite="quick", speculative_config=bad)
            bench_cli.build_config(bench_cli.resolve(bad_args), bad_args)


def test_two_drafts_are_two_variants_named_by_their_drafts():
    """Two draft models with the same settings (the stock 0.5B and a distilled copy) must not share
    a name: the results are keyed by it, and one draft's would overwrite the other's."""
    args = _args(suite="quick", speculative_config='[{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", '
                                                   '"quantization": "q4_0"}, {"method": "draft_model", '
                                                   '"model": "/cache/heads/t/draft/", "quantization": "q4_0"}]')
    c = bench_cli.build_config(bench_cli.resolve(args), args)
    drafts = [v for v in c.variants if v.method == "draft_model"]
    assert [v.name for v in drafts] == ["draft_model K=4 model=qwen2.5-coder-0.5b-instruct",
                                        "draft_model K=4 model=qwen2.5-coder-0.5b-instruct quantization=q4_0",
                                        "draft_model K=4 model=draft quantization=q4_0"]
    assert [v.draft for v in drafts][-1] == "/cache/heads/t/draft/"
    # one draft only: the name stays short
    one = _args(suite="quick", speculative_config='{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", '
                                                  '"quantization": "q4_0"}')
    assert [v.name for v in bench_cli.build_config(bench_cli.resolve(one), one).variants][-1] == \
        "draft_model K=4 quantization=q4_0"
    # two heads whose directories end in the same name cannot be told apart: refused, with the name
    same = _args(suite="quick", speculative_config='[{"method": "eagle3", "model": "/a/eagle3"}, '
                                                   '{"method": "eagle3", "model": "/b/eagle3"}]')
    with pytest.raises(ConfigError, match="would share a name"):
        bench_cli.build_config(bench_cli.resolve(same), same)


def test_suite_fills_in_what_the_flags_leave_out():
    args = _args(suite="quick", max_tokens=12)
    s = bench_cli.resolve(args)
    assert s["model"] == bench_cli.QWEN15 and s["draft_model"] == bench_cli.QWEN05
    assert s["max_tokens"] == 12 and s["num_prompts"] == 2
    c = bench_cli.build_config(s, args)
    assert [v.name for v in c.variants] == ["none", "ngram K=4 n=2..4", "draft_model K=4"]
    cmd = bench_cli.command_line(s, args)
    assert "--max-tokens 12" in cmd and "--draft-model qwen2.5-coder-0.5b-instruct" in cmd
    assert bench_cli.resolve(_args(temperature=0.8))["num_seeds"] == 32


def test_a_draft_through_text_is_its_own_variant():
    """--speculative-config with cross_tokenizer beside --draft-model: two draft_model variants, the
    second named by its draft, and its spec asks for the text path."""
    args = _args(suite="quick", speculative_config='{"method": "draft_model", "model": "smollm2-135m-instruct", '
                                                   '"cross_tokenizer": true, "num_speculative_tokens": 4}')
    c = bench_cli.build_config(bench_cli.resolve(args), args)
    assert [v.name for v in c.variants][-2:] == ["draft_model K=4", "draft_model K=4 text smollm2-135m-instruct"]
    assert c.variants[-1].spec("d")["cross_tokenizer"] is True and "cross_tokenizer" not in c.variants[-2].spec("d")


@pytest.mark.parametrize("kw, match", [
    ({"methods": "none,eagle"}, "unknown method"),
    ({"methods": "draft_model"}, "needs --draft-model"),
    ({"peers": "vllm"}, "unknown peer"),
    ({"datasets": "nonesuch"}, "unknown data set"),
    ({"num_speculative_tokens": "2,x"}, "comma-separated integers"),
    ({"num_speculative_tokens": "40"}, "num_speculative_tokens"),
    ({"temperature": 0.5, "num_seeds": 1}, "num-seeds"),
    ({"adaptive": "maybe"}, "--adaptive takes"),
])
def test_bad_flags_are_clear_errors(kw, match):
    args = _args(**kw)
    with pytest.raises(ConfigError, match=match):
        bench_cli.build_config(bench_cli.resolve(args), args)


def test_top2_margin_reads_the_targets_next_token():
    engine = Engine(EngineConfig(model="tiny", dtype="float32", max_num_seqs=1), target=TINY)
    prompt = [5, 17, 33, 2, 9, 40, 41]
    out = engine.generate_ids([prompt], [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)])[0]
    for i in range(3):
        m = top2_margin(engine.decoder, prompt + out.token_ids[:i])
        assert m["top1_token"] == out.token_ids[i]
        assert m["margin"] == m["top1_logit"] - m["top2_logit"] >= 0
    assert m["ulp"] > 0 and isinstance(m["rounding_level"], bool)


def test_divergences_name_the_position_and_the_margin():
    decoder = Decoder(TINY.config, TINY.weights)
    req = Request("x/1#1", "x", "c", "1", 1, "", [5, 17, 33])
    block = [{"variant": "none", "repeat": 0, "token_ids": [1, 2, 3]},
             {"variant": "ngram K=2 n=1..4", "repeat": 0, "token_ids": [1, 2, 3]},
             {"variant": "draft_model K=2", "repeat": 0, "token_ids": [1, 7, 3]}]
    h = Harness(BenchConfig(model="tiny", variants=[], datasets=[]), progress=False)
    divs = h._divergences(decoder, req, block, {})
    assert [r.get("identical_to_none") for r in block] == [True, True, False]
    assert len(divs) == 1
    d = divs[0]
    assert (d["variant"], d["position"], d["none_token"], d["variant_token"]) == ("draft_model K=2", 1, 2, 7)
    assert d["margin"] == pytest.approx(top2_margin(decoder, [5, 17, 33, 1])["margin"])


def test_a_missing_peer_is_skipped_with_a_note(monkeypatch):
    monkeypatch.setattr(peers, "_installed", lambda name: False)
    notes: list[str] = []
    cfg = BenchConfig(model="tiny", variants=[Variant("none")], datasets=[], peers=["transformers", "llama_cpp"])
    out = peers.run_peers(cfg, "tiny.gguf", None, {0}, [], [], notes, progress=False)
    assert out["runs"] == [] and [s["status"] for s in out["status"]] == ["missing", "missing"]
    assert len(notes) == 2 and all("not installed" in n and "quickdraft[peers]" in n for n in notes)


def test_peer_summary_pairs_with_the_quickdraft_twin():
    requests = [{"id": f"d/{i}#1", "dataset": "d", "category": "c"} for i in range(2)]
    qd = [{"variant": v, "request": f"d/{i}#1", "repeat": 0, "tokens_per_second": tps, "token_ids": [1, 2]}
          for v, tps in (("none", 10.0), ("ngram K=4 n=1..4", 20.0), ("ngram K=2 n=1..4", 15.0)) for i in range(2)]
    runs = [{"request": f"d/{i}#1", "peer": "p", "method": m, "name": f"p {m}", "tokens_per_second": tps,
             "ttft_s": 0.1, "token_ids": [1, 2] if i == 0 else [1, 3]}
            for m, tps in (("plain", 5.0), ("prompt_lookup", 8.0)) for i in range(2)]
    methods = [{"name": f"p {m}", "peer": "p", "method": m} for m in ("plain", "prompt_lookup")]
    vm = {"none": {"method": "none", "k": 0}, "ngram K=4 n=1..4": {"method": "ngram", "k": 4},
          "ngram K=2 n=1..4": {"method": "ngram", "k": 2}}
    rows = peers.summarize(methods, runs, requests, qd, 4, vm)
    lookup = next(r for r in rows if r["method"] == "prompt_lookup")
    assert lookup["quickdraft_variant"] == "ngram K=4 n=1..4"
    assert lookup["quickdraft_over_peer"] == pytest.approx(20 / 8)
    assert lookup["speedup_over_own_plain"] == pytest.approx(8 / 5)
    assert lookup["fraction_identical_to_quickdraft_none"] == 0.5


def test_limit_per_data_set():
    assert bench_cli._limits("3", ["humaneval", "mtbench"]) == {"humaneval": 3, "mtbench": 3}
    assert bench_cli._limits("humaneval=4,mtbench=0", ["humaneval", "mtbench", "x.jsonl"]) == \
        {"humaneval": 4, "mtbench": None, "x.jsonl": None}
    with pytest.raises(ConfigError, match="not in --datasets"):
        bench_cli._limits("mtbench=2", ["humaneval"])
    with pytest.raises(ConfigError, match="name=number"):
        bench_cli._limits("lots", ["humaneval"])


def test_standard_suite_resolves():
    args = _args(suite="standard")
    c = bench_cli.build_config(bench_cli.resolve(args), args)
    assert c.limit == {"humaneval": 4, "mtbench": 8}
    assert len(c.variants) == 1 + 2 * 4 and c.peers == ["transformers", "llama_cpp", "llama_server"]


def test_each_plain_run_is_held_to_the_floor_of_its_own_moment():
    """A shared machine's bandwidth drifts: a plain run that met a fast minute is measured against
    the probe taken beside it, not against one taken at the start of the run."""
    from quickdraft.bench.floor import floor
    from quickdraft.bench.report import floor_line

    def probe(gb_s):
        return {"bandwidth_bytes_per_s": gb_s * 1e9, "best_seconds": 0.01, "buffer_bytes": 1 << 28, "repeats": 3,
                "threads": 2, "method": "torch.sum(float32)"}

    per_token = 10**9  # bytes of weights a token
    fl = floor([(probe(35), 30.0), (probe(62), 50.0), (probe(34), 31.0)], per_token)
    # each run over its own floor: 30/35, 50/62, 31/34; the median, 30/35
    assert fl["fraction_of_floor"] == pytest.approx(30 / 35)
    assert fl["bandwidth_gb_per_s"] == pytest.approx(35) and fl["bandwidth_gb_per_s_range"] == pytest.approx([34, 62])
    assert fl["floor_tokens_per_second"] == pytest.approx(35) and fl["none_tokens_per_second"] == 31.0
    assert fl["probes"] == 3 and fl["threads"] == 2 and "best_seconds" not in fl
    assert "median of 3 probes beside the plain runs, 34.0-62.0 GB/s" in floor_line(fl)
    assert "86% of the floor beside it (median)" in floor_line(fl)
    alone = floor([(probe(35), None)], per_token)  # no plain run measured: the bandwidth alone
    assert alone["fraction_of_floor"] is None and alone["none_tokens_per_second"] is None
