"""``quickdraft profile``: the planner's K and expected speedup by batch and acceptance rate."""

from __future__ import annotations

import json

import pytest

from quickdraft.commands.cli import main
from quickdraft.commands.profile import predict
from quickdraft.kernels import native_decoder
from quickdraft.models.pass_cost import LinearCost


def test_predict_turns_speculation_off_where_rows_are_dear():
    target = LinearCost([(1, 0.12), (33, 0.12 + 32 * 0.011)])  # the 1.5B target here: 11 ms a row
    draft = LinearCost([(1, 0.03), (33, 0.03 + 32 * 0.0044)])
    rows = {(r["batch"], r["acceptance"]): r for r in predict(target, draft, 4, [1, 16], [0.2, 0.9])}
    assert rows[1, 0.9]["k"] > 0 and rows[1, 0.9]["speedup"] > 1.5
    assert rows[1, 0.2]["k"] == 0 and rows[1, 0.2]["speedup"] == 1.0
    assert rows[16, 0.9]["speedup"] < rows[1, 0.9]["speedup"]
    assert all(r["speedup"] >= 1.0 for r in rows.values())  # the plan never expects a loss


def test_profile_command(capsys, tmp_path, smollm2_path):
    png = tmp_path / "plan.png"
    code = main(["profile", "--model", str(smollm2_path), "--speculative-config", '{"method": "ngram"}',
                 "--batch-size", "1,4", "--acceptance-rates", "0.3,0.8", "--json", "--plot", str(png)])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    cost = out["target_cost"]  # a busy machine may fit the fixed cost at 0 and put it all in the rows
    assert cost["a_s"] + cost["b_s_per_row"] > 0 and out["draft_cost"] is None
    assert len(out["plan"]) == 4 and all(0 <= r["k"] <= 4 and r["speedup"] >= 1.0 for r in out["plan"])
    assert png.stat().st_size > 10_000
    split = out["split"]
    assert "draft" not in split  # ngram has no draft model
    p = split["target"]
    assert p["floor_ms"] > 0 and p["total_ms"] == pytest.approx(p["forward_ms"] + p["head_ms"])
    if p["matrices_ms"] is not None:  # the kernels run the layers: the parts add up to the pass
        parts = p["matrices_ms"] + p["attention_ms"] + p["other_layer_ms"]
        assert min(p["matrices_ms"], p["attention_ms"], p["other_layer_ms"]) > 0 and parts < p["forward_ms"]
    for name, temperature in (("engine", 0.0), ("engine_sampled", 0.7)):  # a greedy step, and a sampled one
        e = split[name]
        assert e["steps"] == 32 and e["temperature"] == temperature and 0 < e["models_ms"] < e["step_ms"]
        assert 0 < e["engine_ms"] < e["step_ms"]
        assert set(e["phases_ms"]) == {"propose", "plan", "build", "forward", "verify", "commit"}


def test_profile_splits_the_draft_pass_too(capsys):
    """With a draft model, its one-row pass is split beside the target's, and the text says both."""
    code = main(["profile", "--model", "smollm2-135m-instruct", "--draft-model", "smollm2-135m-instruct",
                 "--num-speculative-tokens", "2", "--batch-size", "1", "--acceptance-rates", "0.5"])
    assert code == 0
    out = capsys.readouterr().out
    assert "\ntarget | " in out and "\ndraft  | " in out and "the engine" in out
    assert "(median of 32, greedy)" in out and "(median of 32, sampled at temperature 0.7)" in out
    if native_decoder() is not None:  # the draft's greedy chains run in one native call there: timed too
        assert "draft greedy chains of 2 passes in one native call: " in out


@pytest.mark.parametrize("cache_mib, noted", [(300, ["draft"]), (32, []), (None, [])])
def test_a_model_the_cache_can_hold_is_noted(cache_mib, noted):
    """A model whose weights are under twice the last-level cache may be read partly from it, past
    100% of the memory's floor: the text says so, for that model alone."""
    from quickdraft.commands.profile import _split_lines

    def one_pass(weight_mib):
        return {"context": 256, "bandwidth_gb_per_s": 30.0, "total_ms": 5.0, "floor_ms": 4.0, "floor_share": 0.8,
                "matrices_ms": 4.0, "layers_floor_ms": 3.0, "matrices_share": 0.75, "attention_ms": 0.3,
                "other_layer_ms": 0.2, "outside_layers_ms": 0.1, "head_ms": 0.4, "head_floor_ms": 0.3, "head_share": 0.75,
                "layer_weight_bytes": (weight_mib - 50) << 20, "head_weight_bytes": 50 << 20}

    engine = {"steps": 32, "temperature": 0.0, "step_ms": 50.0, "models_ms": 49.0, "engine_ms": 1.0, "phases_ms": {}}
    split = {"target": one_pass(951), "draft": one_pass(235), "engine": engine,
             "last_level_cache_bytes": None if cache_mib is None else cache_mib << 20}
    notes = [line for line in _split_lines(split) if line.startswith("note:")]
    assert [line.split()[2].removesuffix("'s") for line in notes] == noted
    assert all("(235 MiB)" in line and f"({cache_mib} MiB)" in line for line in notes)


def test_profile_needs_a_method(capsys):
    assert main(["profile", "--model", "smollm2-135m-instruct"]) == 2
    assert "needs --speculative-config" in capsys.readouterr().err
