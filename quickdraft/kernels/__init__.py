"""Hand-written CPU kernels, compiled on first use with torch's C++ extension loader and cached
under ``$QUICKDRAFT_CACHE/extensions/torch-<version>-<source hash>-<instruction set>``: a bfloat16
and a float32 linear for the decoder, an int8 linear (int8 weights and activations, W8A8) for
draft models (linear.h), a linear over GGUF block weights as stored (blocks.h, models/ggml.py), a
chain's attention (attention.cpp), RMSNorm and rotary (rows.cpp), the verifier's and sampler's
rows (verify.cpp), a whole decoder layer made of them (layer.cpp) and the whole decoder in one
call (forward.cpp), registered with Python in bindings.cpp, each written once against the vector
layer (simd.h, over arch/) and built for the instruction set ``isa.choose()`` picks. Each has a
plain torch fallback: where the compiler is missing or ``QUICKDRAFT_KERNELS=0``, the getters
return None and the caller uses torch. The layer imports nothing of quickdraft, and no torch
until a kernel is asked for.

The kernels are batch invariant by construction (see linear.h, tiles.h); torch's matmul is not, and how
it fails depends on the CPU and its BLAS (MKL picks another float32 kernel for 13 rows and up on
an Intel Xeon with AMX, and for 1..3 tail rows on an AMD EPYC; cuBLAS picks by shape).
``invariance(dtype, device, blocks)`` says which path a linear takes, and whether that path promises it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quickdraft.kernels import isa as isas

if TYPE_CHECKING:
    import torch

HERE = Path(__file__).parent
# compiled into one module: its Python bindings, then the kernels
SOURCES = ("bindings.cpp", "linear.cpp", "blocks.cpp", "attention.cpp", "rows.cpp", "verify.cpp", "layer.cpp", "forward.cpp")
# the walk (tiles.h), the entry points (entry.h), the vector layer (simd.h) and its instruction sets
# (arch/isa_*.h), the cores on raw pointers (linear.h, blocks.h, attention.h, rowwise.h) and AMX
# (arch/amx_x86.h); paths relative to this folder, kept in the build's copy
HEADERS = ("tiles.h", "entry.h", "layer.h", "simd.h", "arch/isa_avx512.h", "arch/isa_avx2.h", "arch/isa_neon.h",
           "arch/isa_portable.h", "linear.h", "blocks.h", "attention.h", "rowwise.h", "arch/amx_x86.h")


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (for cache keys: costs and kernel paths differ by CPU)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "unknown")


@functools.cache
def source_hash() -> str:
    """A short hash of the kernels' sources: a new kernel invalidates what was measured with the old."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((HERE / name).read_bytes())
    return h.hexdigest()[:16]


def chosen_isa() -> isas.Isa:
    """The instruction set the kernels are built for here (``isa.choose``: the best the CPU runs,
    or ``QUICKDRAFT_ISA``)."""
    return isas.choose()


def path_name() -> str:
    """The kernels' path as the user sees it: "avx512-avx512_bf16", "avx2", "neon", "portable",
    or "torch" where the kernels are off or did not build."""
    module = _module()
    return "torch" if module is None else chosen_isa().key(isas.cpu_features())


def bf16_linear():
    """The compiled ``linear_bf16(x [M, K], w [N, K], bias [N] | None) -> [M, N]``, or None."""
    module = _module()
    return None if module is None else module.linear_bf16


def f32_linear():
    """The compiled ``linear_f32(x [M, K], w [N, K], bias [N] | None) -> [M, N]`` (float32), or None."""
    module = _module()
    return None if module is None else module.linear_f32


def int8_linear():
    """The compiled ``linear_w8(x [M, K] bf16, w [N, K] int8, scale [N] f32, wsum [N] i32, bias) -> [M, N]``
    (x quantized to int8 per row inside), or None."""
    module = _module()
    return None if module is None else module.linear_w8


def block_linear():
    """The module holding the compiled GGUF block-format linear (``linear_blocks``: see
    blocks.cpp), or None."""
    return _module()


def amx_active() -> bool:
    """Whether the block kernels run passes of many rows (``amx_min_rows()``, 12) on AMX: the CPU has
    AMX-INT8, Linux grants the process its tile state, and ``QUICKDRAFT_AMX`` is not 0 (blocks.cpp,
    "AMX")."""
    module = _module()
    return module is not None and module.amx_active()


def chain_attention():
    """The compiled ``attend_chain(q [m, H, d] f32, keys, values [Hkv, L, d], ctx, scale) -> [m, H * d]``
    (row j over keys 0..ctx+j; see attention.cpp), or None."""
    module = _module()
    return None if module is None else module.attend_chain


def tree_attention():
    """The compiled ``attend_tree(q [m, H, d] f32, keys, values [Hkv, L, d], ctx, start [m + 1],
    path, scale) -> [m, H * d]`` (row j over the context and its own path of new tokens, with the
    bits of the chain row of the same history; see attention.cpp), or None."""
    module = _module()
    return None if module is None else module.attend_tree


def rowwise():
    """The compiled ``rms_norm(x, weight, eps)`` and ``rotary(x, cos, sin, positions)`` (see
    rows.cpp), and the verifier's rows (verify.cpp), as the module that holds them, or None."""
    return _module()


def fused_layer():
    """The compiled ``decoder_layer`` (one decoder layer for chains or trees of new tokens in one call; see
    layer.cpp), or None."""
    module = _module()
    return None if module is None else module.decoder_layer


def native_decoder():
    """The compiled ``NativeDecoder`` class (a model's decoder layers and final norm, run in one call a
    pass over a reused workspace; see forward.cpp), or None."""
    module = _module()
    return None if module is None else module.NativeDecoder


def dense_linear(dtype: torch.dtype, device: torch.device | str):
    """The kernel for a ``dtype`` weight and activations on ``device``, or None (then torch's linear)."""
    import torch

    if torch.device(device).type != "cpu":
        return None
    if dtype == torch.bfloat16:
        return bf16_linear()
    if dtype == torch.float32:
        return f32_linear()
    return None


@dataclass(frozen=True)
class Invariance:
    """Whether a token's logits are promised not to depend on the rest of the pass (the other
    draft tokens, other requests), which is what makes speculative output equal plain output bit
    for bit rather than only to rounding."""

    promised: bool
    path: str  # the linear path the decoder takes: "f32-avx512", "bf16-avx2", "gguf-blocks-bf16-avx512-amx", "torch-cpu", ...
    why: str  # one line for the user
    kernels: str = "torch"  # the CPU kernels' build (``path_name()``: "avx512-avx512_bf16", "avx2", "neon", "portable")

    def to_dict(self) -> dict:
        return asdict(self)


def invariance(dtype: torch.dtype, device: torch.device | str, blocks: bool = False) -> Invariance:
    """What the decoder's linear promises for ``dtype`` activations on ``device`` on this machine,
    with dense weights or (``blocks``) GGUF block weights (blocks.cpp)."""
    import torch

    device = torch.device(device)
    name = {torch.float32: "f32", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))
    name = f"gguf-blocks-{name}" if blocks else name
    if device.type != "cpu":
        return Invariance(False, f"torch-{device.type}",
                          f"{device.type}: the vendor BLAS picks its kernel by the number of rows, so a row can round "
                          "differently in a verification pass than alone; greedy output equals plain decoding "
                          "except where the top two logits are within rounding")
    if dense_linear(dtype, device) is not None:  # the block kernels live in the same module
        isa, build = chosen_isa().name, path_name()
        if blocks and amx_active():
            return Invariance(True, f"{name}-{isa}-amx",
                              "quickdraft's own kernel: exact integer block sums (VNNI for a few rows, AMX for more) "
                              "meet float in one sequence per output, whatever the rows", build)
        return Invariance(True, f"{name}-{isa}",
                          f"quickdraft's own kernel ({isa}): one instruction sequence per output, whatever the rows", build)
    return Invariance(False, "torch-cpu", f"torch's matmul, whose rounding may depend on the row count: {_why_no_kernel(dtype)}")


def _why_no_kernel(dtype: torch.dtype) -> str:
    import torch

    if dtype not in (torch.float32, torch.bfloat16):
        return f"no kernel for {dtype}"
    if os.environ.get("QUICKDRAFT_KERNELS", "1") == "0":
        return "QUICKDRAFT_KERNELS=0"
    return "the kernels did not build (see the warning above)"


def cache_dir() -> Path:
    """``$QUICKDRAFT_CACHE``, or ``~/.cache/quickdraft`` (models/registry.py's ``cache_dir``, read
    here so that the kernels import nothing of the layers above them); created on first use."""
    root = Path(os.environ.get("QUICKDRAFT_CACHE") or Path.home() / ".cache" / "quickdraft")
    root.mkdir(parents=True, exist_ok=True)
    return root


# A build takes 3-7 minutes here; a build lock older than this was left by one that was killed.
STALE_LOCK_S = 30 * 60


def _clear_stale_lock(build: Path) -> None:
    """torch's build lock (``FileBaton``: a bare file, with no owner and no timeout) is left behind
    by a build killed mid-way (Ctrl-C, a test's timeout), and every later first use of this source
    version then waits on it forever. One older than any build is removed, with a warning."""
    lock = build / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        warnings.warn(f"quickdraft: removing {lock}, a kernel build lock left {age / 60:.0f} minutes ago by a "
                      "build that did not finish", stacklevel=3)
        lock.unlink(missing_ok=True)


@functools.cache
def _module():
    if os.environ.get("QUICKDRAFT_KERNELS", "1") == "0":
        return None
    return build(chosen_isa())


def build(isa: isas.Isa):
    """The kernels compiled for ``isa`` (built on first use, then loaded from the cache), or None
    with a warning where they do not build. One module per instruction set and source version."""
    import torch
    from torch.utils import cpp_extension

    features = isas.cpu_features()
    key = isa.key(features)
    # One build directory per source version and ISA, compiled from its own copy of the sources:
    # ninja keys its build on the sources' paths, so two checkouts of the same version in
    # different folders would otherwise rebuild over each other at every first use.
    build = cache_dir() / "extensions" / f"torch-{torch.__version__}-{source_hash()}-{key}"
    src = build / "src"
    src.mkdir(parents=True, exist_ok=True)
    for name in SOURCES + HEADERS:
        copy = src / name
        copy.parent.mkdir(exist_ok=True)  # arch/
        if not copy.exists() or copy.read_bytes() != (HERE / name).read_bytes():
            tmp = copy.with_suffix(copy.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes((HERE / name).read_bytes())
            os.replace(tmp, copy)  # atomic: a concurrent build reads the old bytes or the new, never half
    _clear_stale_lock(build)
    try:
        # -ffp-contract=off: a lane's float operations are exactly the ones written (simd.h), so
        # the compiler cannot fuse a multiply and an add in one ISA's build and not in another's
        module = cpp_extension.load(
            name=f"quickdraft_kernels_{key.replace('-', '_')}", sources=[str(src / name) for name in SOURCES],
            build_directory=str(build), extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp", *isa.flags(features)],
            extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, ...: correct but slower
        warnings.warn(f"quickdraft: the CPU kernels ({key}) did not build ({e}); using torch's linear", stacklevel=2)
        return None
    return module
