"""The decoder's row-wise operations: the linear projection in every weight format, RMSNorm, the
MLP's SiLU and rotary position embeddings, each on quickdraft's CPU kernels where they run and on
torch elsewhere.

Batch invariance (docs/design/batch-invariance.md): the projections take quickdraft's own CPU kernels
(kernels/linear.cpp), invariant by construction in float32, bfloat16 and int8 on every instruction
set they are built for (kernels/simd.h: AVX-512, AVX2, NEON and a portable one). torch's matmul is
not: on an AMD EPYC its float32 tail rows (1..3 past a multiple of four) take another kernel, and
on an Intel Xeon with AMX every float32 row count from 13 up does; so the torch fallback pads rows
to a multiple of ``ROW_MULTIPLE`` on a CPU, which helps on some CPUs (cuBLAS gets them unpadded),
and ``Decoder.batch_invariance`` says it promises nothing. Norms and rotary are per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quickdraft.models.families import SILU
from quickdraft.models.ggml import BlockWeight
from quickdraft.kernels import dense_linear, rowwise
from quickdraft.models.quant import Int8Weight
from quickdraft.models.rope import Rope, rotary_tables

ROW_MULTIPLE = 4


def _padded(n: int) -> int:
    return -(-n // ROW_MULTIPLE) * ROW_MULTIPLE


def _pad_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    n = x.shape[0]
    if n % ROW_MULTIPLE == 0:
        return x, n
    return torch.cat([x, x.new_zeros((_padded(n) - n,) + x.shape[1:])]), n


def _bmm_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [batch, rows, k] @ b [batch, k, n], with rows padded to a multiple of ROW_MULTIPLE for batch invariance."""
    padded, rows = _pad_rows(a.transpose(0, 1))  # pad the rows dimension
    return torch.matmul(padded.transpose(0, 1), b)[:, :rows]


def linear(x: torch.Tensor, weight: "torch.Tensor | Int8Weight | BlockWeight", bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] @ weight[out, in].T (+ bias) -> [n, out]. A quantized weight (the int8 draft
    format, models/quant.py; GGUF blocks, models/ggml.py) multiplies itself. A dense one takes our
    batch-invariant CPU kernel for float32 and bfloat16 where the CPU has it (kernels/), else
    torch's linear with the rows padded to a multiple of ROW_MULTIPLE."""
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x, bias)
    kernel = dense_linear(x.dtype, x.device) if x.dtype == weight.dtype and weight.is_contiguous() else None
    if kernel is not None:
        return kernel(x, weight, bias)
    if x.device.type != "cpu":  # cuBLAS picks its kernel by shape: padding would buy nothing
        return F.linear(x, weight, bias)
    xp, n = _pad_rows(x)
    return F.linear(xp, weight, bias)[:n]


def nbytes(w) -> int:
    """Bytes of a weight in any format (a dense tensor, Int8Weight, BlockWeight)."""
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [n, hidden]: normalized in float32, returned in x's dtype. With a weight of x's dtype as
    Hugging Face's LlamaRMSNorm (rounded, then times the weight); with a float32 weight as Gemma's
    (times the weight in float32, rounded once: models/families.py's unit offset). On the CPU in one
    call (kernels/rows.cpp)."""
    gemma = weight.dtype != x.dtype
    if gemma and weight.dtype != torch.float32:
        raise ValueError(f"a norm's weight of {weight.dtype} for {x.dtype} rows: of their dtype or float32")
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16):
        kernels = rowwise()
        if kernels is not None:
            return kernels.rms_norm(x, weight, eps)
    if x.device.type != "cpu":  # one fused kernel on a GPU instead of five
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    else:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight).to(x.dtype) if gemma else weight * normed.to(x.dtype)


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: int = SILU) -> torch.Tensor:
    """The gated MLP's act(gate) * up (SwiGLU's SiLU, or Gemma's GELU with the tanh approximation:
    families.py), each step rounded to the dtype; on the CPU in one call (kernels/rowwise.h, with
    its own exponent: the same bits on every instruction set, which torch's SiLU and tanh do not
    promise), elsewhere torch's."""
    if gate.device.type == "cpu" and gate.dtype in (torch.float32, torch.bfloat16) and up.dtype == gate.dtype:
        kernels = rowwise()
        if kernels is not None:
            return kernels.act_mul(gate, up, activation)
    return (F.silu(gate) if activation == SILU else F.gelu(gate, approximate="tanh")) * up


class Rotary:
    """Rotary position embedding (Su et al. 2021) in the rotate-half layout of Hugging Face, with
    the tables of models/rope.py (its scaling and attention factor folded in)."""

    def __init__(self, head_dim: int, theta: float | Rope, max_positions: int, device):
        """``theta``: the base of plain RoPE, or a Rope (scaling, partial rotary)."""
        rope = theta if isinstance(theta, Rope) else Rope(float(theta))
        cos, sin = rotary_tables(rope, head_dim, max_positions)  # [max_positions, head_dim] float32
        self.cos = cos.to(device)
        self.sin = sin.to(device)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, 1, head_dim] at ``positions`` [n]."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor, angles: tuple | None = None) -> torch.Tensor:
        """x [n, heads, head_dim], positions [n] -> rotated x (computed in float32; on the CPU in
        one call, kernels/rows.cpp). ``angles``: ``self.angles(positions)`` where the caller
        has them (a pass's layers share them)."""
        kernels = rowwise() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None
        if kernels is not None:
            return kernels.rotary(x, self.cos, self.sin, positions)
        cos, sin = angles if angles is not None else self.angles(positions)
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)
