"""int8 quantization for draft models: weights with one symmetric scale per output row (and, in
the CPU kernel, each row of activations quantized to int8 on the fly, as in LLM.int8 / SmoothQuant's
per-token scheme without outlier handling).

A draft only proposes; the target's verification keeps the output exact whatever the draft
computes. So a draft may trade a little agreement for speed, and on a CPU its cost is the bytes of
weights it reads per token: int8 halves them against bfloat16. The target is never quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.kernels import int8_linear


@dataclass
class Int8Weight:
    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] float32: weight ~= q * scale[:, None]
    qsum: torch.Tensor  # [out] int32: q summed over a row (the int8 kernel's zero-point correction)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Weight":
        w32 = w.float()
        scale = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
        q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scale.contiguous(), q.sum(dim=1, dtype=torch.int32).contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel() + 4 * self.qsum.numel()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, in] @ w.T (+ bias) -> [n, out]."""
        return int8_matmul(x, self, bias)


def quantizable() -> bool:
    """Whether int8 weights run faster here than bfloat16 ones (the kernel exists)."""
    return int8_linear() is not None


def int8_matmul(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] (bfloat16) @ w.T -> [n, out]."""
    kernel = int8_linear()
    if kernel is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return kernel(x, w.q, w.scale, w.qsum, bias)
    return torch.nn.functional.linear(x, w.dequantize(x.dtype), bias)


def quantize_weights(weights: dict[str, torch.Tensor], lm_head: torch.Tensor) -> tuple[dict, Int8Weight]:
    """Every 2-D projection of the blocks, and the output head, as Int8Weight; the embedding stays
    as it is (a lookup reads one row per token)."""
    out = {name: Int8Weight.quantize(t) if t.ndim == 2 and ".layers." in name else t
           for name, t in weights.items() if name != "lm_head.weight"}
    return out, Int8Weight.quantize(lm_head)
