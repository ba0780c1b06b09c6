"""``python -m quickdraft.bench.matrix`` on a real tensor of SmolLM2's file: its figures are there,
and its floor of the arithmetic is the count of vpdpbusd at the rate the kernel measured."""

from __future__ import annotations

import pytest

from quickdraft.bench import matrix
from quickdraft.kernels import block_linear


@pytest.mark.slow
def test_rows_and_the_vnni_floor(smollm2_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matrix, "STREAM_BYTES", 16 << 20)  # fewer copies: the figures' shape is tested, not their speed
    rows = matrix.measure(str(smollm2_path), "blk.0.ffn_gate.weight", [1, 3], rounds=1)
    assert [r["rows"] for r in rows] == [1, 3] and rows[0]["shape"] == [1536, 576]
    assert rows[0]["blocks_vs_1_row"] == 1.0 and all(r["blocks_ms"] > 0 and r["hot_ns_per_512"] > 0 for r in rows)
    if block_linear() is None:
        assert rows[0]["vnni_floor_ms"] is None
        return
    # 3 rows: three times the products, so three times the instructions at the one rate measured
    assert rows[1]["vnni_floor_ms"] == pytest.approx(3 * rows[0]["vnni_floor_ms"])
    rate = 1536 * 576 / 64 / (rows[0]["vnni_floor_ms"] / 1e3)  # vpdpbusd a second, all threads
    assert 1e8 < rate < 1e12, rate
