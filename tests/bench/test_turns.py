"""python -m quickdraft.bench.turns: its summary of measured turns (the servers it starts are
the ones the other server tests use)."""

from __future__ import annotations

from quickdraft.bench.turns import summary, table


def test_summary_by_server_and_turn():
    rows = [{"server": s, "turn": t, "ttft": ttft, "prompt_tokens": p, "cached_tokens": c}
            for s, t, ttft, p, c in [("on", 1, 1.0, 60, 20), ("on", 2, 0.2, 140, 120), ("on", 2, 0.4, 160, 130),
                                     ("off", 1, 1.1, 60, 0), ("off", 2, 2.0, 140, 0), ("off", 2, 3.0, 160, 0)]]
    s = summary(rows)
    assert list(s) == ["on turn 1", "on turn 2", "off turn 1", "off turn 2"]
    assert abs(s["on turn 2"]["ttft_p50"] - 0.3) < 1e-12
    assert s["on turn 2"]["cached_share"] == 250 / 300 and s["off turn 2"]["cached_share"] == 0
    assert s["off turn 2"]["requests"] == 2 and s["on turn 1"]["prompt_tokens_p50"] == 60
    assert "| on turn 2 | 2 | 150 | 83% | 0.300 |" in table(s)
