"""Hand-written CPU kernels, compiled on first use with torch's C++ extension loader and cached
under ``$QUICKDRAFT_CACHE/extensions``: a bfloat16 linear for the decoder, and an int8 linear
(int8 weights and activations, W8A8) for draft models. Each has a plain torch fallback: where the
CPU lacks the instructions, the compiler is missing, or ``QUICKDRAFT_KERNELS=0``, the getters
return None and the caller uses torch."""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

from quickdraft.models.registry import cache_dir

HERE = Path(__file__).parent


def _cpu_has(*flags: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.split())
    return all(f in have for f in flags)


def bf16_linear():
    """The compiled ``linear_bf16(x [M, K], w [N, K], bias [N] | None) -> [M, N]``, or None."""
    module = _module()
    return None if module is None else module.linear_bf16


def int8_linear():
    """The compiled ``linear_w8(x [M, K] bf16, w [N, K] int8, scale [N] f32, wsum [N] i32, bias) -> [M, N]``
    (x quantized to int8 per row inside), or None."""
    module = _module()
    return None if module is None else module.linear_w8


@functools.cache
def _module():
    if os.environ.get("QUICKDRAFT_KERNELS", "1") == "0" or not _cpu_has("avx512f", "avx512_bf16", "avx512bw", "avx512_vnni"):
        return None
    from torch.utils import cpp_extension

    build = cache_dir() / "extensions" / f"torch-{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        module = cpp_extension.load(
            name="quickdraft_bf16_gemm", sources=[str(HERE / "bf16_gemm.cpp")], build_directory=str(build),
            extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-fopenmp"],
            extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, ...: correct but slower
        warnings.warn(f"quickdraft: the CPU kernels did not build ({e}); using torch's linear", stacklevel=2)
        return None
    return module
