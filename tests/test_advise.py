"""``quickdraft advise``: the verdict's rules on hand-built measurements, then the whole command at
tiny size on SmolLM2 (two prompts, a few tokens): its report, plots and JSON."""

from __future__ import annotations

import json

import pytest

from quickdraft.commands.advise import MIN_SPEEDUP, decide, drafters, waves
from quickdraft.commands.cli import main
from quickdraft.errors import ConfigError

MIB = 2**20


def drafter(name, speedups: dict, added_mib: float = 1.0, acceptance: float = 0.5, per_pass: float = 2.5) -> dict:
    return {"name": name, "spec": {"method": name, "num_speculative_tokens": 8},
            "speedup": {str(b): s for b, s in speedups.items()},
            "memory": {str(b): {"added": int(added_mib * MIB)} for b in speedups},
            "runs": [{"acceptance_rate": acceptance, "mean_accepted_length": per_pass}]}


def result(*ds, answer=100.0, headroom=1.2) -> dict:
    return {"baseline": {"answer_tokens_p50": answer}, "drafters": list(ds), "headroom": headroom}


def test_speculate_with_the_fastest_that_fits_and_turn_it_off_where_it_lost():
    r = result(drafter("ngram", {1: 1.3, 4: 1.1, 8: 0.9}), drafter("suffix", {1: 1.6, 4: 0.95, 8: 0.8}, added_mib=500),
               drafter("draft_model", {1: 1.5, 4: 1.2, 8: 1.05}, added_mib=300))
    v = decide(r, budget=400 * MIB)
    assert v["speculate"] and v["drafter"] == "draft_model"  # suffix is faster but does not fit
    assert v["speculative_config"] == {"method": "draft_model", "num_speculative_tokens": 8}  # never lost
    assert any("suffix adds 500 MiB" in reason for reason in v["reasons"])
    v = decide(r, budget=None)
    assert v["drafter"] == "suffix" and v["speculative_config"]["disable_by_batch_size"] == 4
    assert v["text"] == ("speculate with suffix: 1.60x at batch 1, 0.95x at 4, 0.80x at 8; "
                         "off from batch 4, where it measured a loss")
    v = decide(result(drafter("suffix", {1: 1.6})), budget=None)  # one batch size measured
    assert v["text"] == "speculate with suffix: 1.60x at batch 1"


def test_dont_speculate_below_the_threshold_and_say_why():
    v = decide(result(drafter("ngram", {1: MIN_SPEEDUP - 0.01, 4: 1.5}, acceptance=0.1), answer=12), budget=None)
    assert not v["speculate"] and v["speculative_config"] is None
    assert v["text"].startswith("don't speculate: ngram measured")
    assert "acceptance 10%" in v["text"] and "answers are short (median 12 tokens)" in v["text"]


def test_a_speedup_its_tokens_per_pass_cannot_explain_is_noise():
    r = result(drafter("ngram", {1: 1.21, 4: 1.0}, acceptance=0.03, per_pass=1.01),
               drafter("draft_model", {1: 1.16, 4: 1.02}, per_pass=3.29))
    v = decide(r, budget=None)
    assert v["drafter"] == "draft_model"
    assert any("with 1.01 tokens a pass it cannot beat 1.01x" in reason for reason in v["reasons"])


def test_waves_and_drafters():
    assert waves([[1], [2], [3]], 2) == [[[1], [2]], [[3], [1]]]
    assert waves([[1]], 3) == [[[1], [1], [1]]]
    names = [d.name for d in drafters(["ngram", "draft_model"], ["a-draft"], 6)]
    assert names == ["none", "ngram", "draft_model (a-draft)"]
    with pytest.raises(ConfigError, match="not 'eagle'"):
        drafters(["eagle"], [], 4)
    with pytest.raises(ConfigError, match="nothing to compare"):
        drafters([], [], 4)


def test_advise_end_to_end(smollm2_path, tmp_path, capsys):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "The capital of France is Paris. The capital of Italy is Rome. The capital of France is"})
        + "\n" + json.dumps({"turns": ["Count from one to five."]}) + "\n")
    out = tmp_path / "out"
    assert main(["advise", str(prompts), "--methods", "ngram", "--max-tokens", "4", "--batch-size", "1,2",
                 "--max-num-speculative-tokens", "3", "--max-model-len", "256", "--result-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads((out / "results.json").read_text())
    assert [run["batch"] for run in r["baseline"]["runs"]] == [1, 2]
    assert r["baseline"]["runs"][0]["requests"] == 2 and r["baseline"]["runs"][1]["requests"] == 2
    [ngram] = r["drafters"]
    assert set(ngram["speedup"]) == {"1", "2"} and all(s > 0 for s in ngram["speedup"].values())
    assert ngram["memory"]["2"]["verify_scratch"] > ngram["memory"]["1"]["verify_scratch"] > 0
    assert r["verdict"]["text"].split(":")[0] in printed
    report = (out / "report.md").read_text()
    assert "## Verdict" in report and "| ngram |" in report and "(advise_speedup.png)" in report
    assert (out / "advise_speedup.png").stat().st_size > 0
    assert main(["advise", str(tmp_path / "missing.jsonl"), "--result-dir", str(out)]) == 2  # a clear error, not a trace
