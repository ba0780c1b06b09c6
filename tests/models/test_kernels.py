"""The hand-written CPU kernels against plain float arithmetic. They must build on every CPU (the
portable instruction set at least, with any C++ compiler): a silent fallback would make a machine
slow without a word."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quickdraft.kernels import (HEADERS, HERE, SOURCES, STALE_LOCK_S, _clear_stale_lock, _module, bf16_linear,
                                      chosen_isa, int8_linear, isa, path_name)
from quickdraft.models.quant import Int8Weight, int8_matmul

HAS_KERNELS = _module() is not None


def test_kernels_build_for_the_best_isa_this_cpu_runs(monkeypatch):
    """Without QUICKDRAFT_ISA, the best instruction set of the table the CPU runs; the module says
    which it was built for, and the path names it."""
    assert bf16_linear() is not None and int8_linear() is not None
    import os

    if not os.environ.get("QUICKDRAFT_ISA"):
        assert chosen_isa() == isa.best()
    assert _module().isa() == chosen_isa().name and path_name().startswith(chosen_isa().name)


def test_a_build_lock_older_than_any_build_is_removed(tmp_path: Path):
    """A build killed mid-way leaves torch's lock file, and every later build would wait on it
    forever: one older than any build is removed, with a warning; a fresh one (a build running
    now) is left alone."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    _clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="kernel build lock"):
        _clear_stale_lock(tmp_path)
    assert not lock.exists()
    _clear_stale_lock(tmp_path)  # no lock: nothing to do


def test_the_build_reads_its_own_copy_of_the_sources():
    """Two checkouts of one version share a build directory; compiled from the checkout's own
    paths, each would rebuild over the other at every first use."""
    module = bf16_linear() and _module()
    build = Path(module.__file__).parent
    ninja = (build / "build.ninja").read_text()
    assert str(build / "src" / "blocks.cpp") in ninja and str(HERE / "blocks.cpp") not in ninja
    for name in SOURCES + HEADERS:
        assert (build / "src" / name).read_bytes() == (HERE / name).read_bytes()


@pytest.mark.skipif(not HAS_KERNELS, reason="the CPU kernels did not build")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 17])
@pytest.mark.parametrize("n,k", [(96, 64), (1000, 896), (130, 1536)])
def test_bf16_kernel_matches_float_reference(rows, n, k):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    ref = x.float() @ w.float().T + b.float()
    y = bf16_linear()(x, w, b)
    # float32 accumulation in another order, then one rounding to bfloat16 (2^-8 relative)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert torch.allclose(y.float(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


@pytest.mark.parametrize("rows", [1, 4, 7])
def test_int8_matmul_is_close_to_the_dequantized_weights(rows):
    """Activations are quantized per row to int8 as well: agreement to ~1% of the output scale."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 896, generator=g).to(torch.bfloat16)
    w = Int8Weight.quantize(torch.randn(300, 896, generator=g))
    ref = x.float() @ w.dequantize(torch.float32).T
    y = int8_matmul(x, w, None).float()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 0.02
    assert w.q.dtype == torch.int8 and torch.equal(w.qsum, w.q.sum(1, dtype=torch.int32))
