"""The results schema checker (bench/schema.py)."""

from __future__ import annotations

from quickdraft.bench import schema


def test_schema_checker_names_what_is_wrong():
    good = {"n": 1, "median": 1.0, "geomean": None, "p10": 1, "p90": 2.5}
    assert schema.errors(good, schema.SPEEDUP) == []
    bad = {"n": -1, "median": "fast", "p10": True, "p90": 1.0}
    problems = schema.errors(bad, schema.SPEEDUP)
    assert any("missing 'geomean'" in p for p in problems)
    assert any("$.median: expected number" in p for p in problems)
    assert any("$.p10" in p for p in problems)  # a bool is not a number
    assert any("-1 < 0" in p for p in problems)
    assert schema.errors({"method": "eagle"}, schema.VARIANT)[0].startswith("$: missing")
