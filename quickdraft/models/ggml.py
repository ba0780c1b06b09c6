"""GGUF block-quantized weights kept as stored, repacked once at load for the CPU kernels.

A CPU decoding step reads every weight once, so its cost is the bytes read: a Q4_K_M file's
weights are ~4.8 bits each where bfloat16 is 16. ``BlockWeight`` holds a projection in one of two
layouts (kernels/blocks.cpp), exactly as ggml dequantizes it (``w = scale * q - min``):

- ``u4``: 4-bit values with one float scale and one float min per 32 weights: Q4_0, Q4_1, Q4_K
  (the K-quant's 6-bit sub-block scales and mins multiplied out, as ggml does);
- ``i8``: int8 values with one float scale per 16 weights: Q8_0, Q5_0 and Q6_K.

The repacked scales are float32, so a Q4_K weight takes 6 bits here (4.5 in the file) and a
Q6_K one 10 (6.6): simple layouts first, tighter ones are left for later. The kernels quantize
each row of activations to int8 in blocks of 32 (ggml's Q8_0), so a product is not the float
product with the dequantized weights; it is close (tested), and batch invariant bit for bit.
Where the kernels are missing (another CPU, CUDA, ``QUICKDRAFT_KERNELS=0``) ``linear``
dequantizes and uses torch: correct, slower, and not invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from quickdraft.models.kernels import block_linear

# type name -> (weights per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q4_K": (256, 144),
          "Q6_K": (256, 210)}
LAYOUT = {"Q4_0": "u4", "Q4_1": "u4", "Q4_K": "u4", "Q8_0": "i8", "Q5_0": "i8", "Q6_K": "i8"}


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n] float32 (little-endian float16)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] values: the low nibbles, then the high ones (ggml's Q4_0 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _unpack(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """[num_blocks, bytes] -> (q [num_blocks, per_block] ints, scale, min) with one scale (and min)
    per 32 weights (u4) or per 16 (i8), as ggml's dequantize_row_* computes them."""
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(blocks[:, 0:2])
        if kind == "Q4_0":
            return _nibbles(blocks[:, 2:18]), d, 8.0 * d
        return _nibbles(blocks[:, 4:20]), d, -_f16(blocks[:, 2:4])
    if kind == "Q8_0":
        d = _f16(blocks[:, 0:2])
        return blocks[:, 2:34].view(np.int8).astype(np.int32), np.repeat(d, 2), None
    if kind == "Q5_0":
        d = _f16(blocks[:, 0:2])
        qh = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32).reshape(-1, 1)
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32) << 4  # [n, 32]
        return _nibbles(blocks[:, 6:22]).astype(np.int32) + high - 16, np.repeat(d, 2), None
    if kind == "Q4_K":
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        s = blocks[:, 4:16].astype(np.int32)  # 8 six-bit scales and mins, packed in 12 bytes
        sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
        mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
        qs = blocks[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 64 weights: low nibbles, then high
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
        return q, (d[:, None] * sc).reshape(-1), (dmin[:, None] * mn).reshape(-1)
    if kind == "Q6_K":
        ql, qh = blocks[:, 0:128].astype(np.int32), blocks[:, 128:192].astype(np.int32)
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks[:, 208:210])
        halves = []
        for h in range(2):  # each half of 128 weights: 64 bytes of ql, 32 of qh
            lo, hi = ql[:, 64 * h : 64 * h + 64], qh[:, 32 * h : 32 * h + 32]
            halves += [(lo[:, :32] & 0x0F) | ((hi & 3) << 4), (lo[:, 32:] & 0x0F) | (((hi >> 2) & 3) << 4),
                       (lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4), (lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4)]
        return np.concatenate(halves, axis=1) - 32, (d[:, None] * sc).reshape(-1), None
    raise ValueError(f"no block layout for {kind}")


@dataclass
class BlockWeight:
    """A projection [out, in] in a GGUF block format, repacked for kernels/blocks.cpp."""

    ggml_type: str  # the file's type: "Q4_K", "Q6_K", ...
    q: torch.Tensor  # u4: [out, in / 2] uint8, byte j of each 32 = w[j] | w[j + 32] << 4; i8: [out, in] int8
    scale: torch.Tensor  # [out, in / 32] (u4) or [out, in / 16] (i8) float32
    min: torch.Tensor | None  # [out, in / 32] float32 (u4), None (i8)

    @property
    def layout(self) -> str:
        return LAYOUT[self.ggml_type]

    @property
    def shape(self) -> torch.Size:
        out, cols = self.q.shape
        return torch.Size((out, cols * 2 if self.layout == "u4" else cols))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.min) if t is not None)

    @classmethod
    def from_gguf(cls, kind: str, data: np.ndarray, shape: tuple[int, int]) -> "BlockWeight":
        """``data``: the tensor's raw bytes as stored; ``shape``: its torch shape [out, in]."""
        out, cols = shape
        per_block, nbytes = BLOCKS[kind]
        if cols % 64:
            raise ValueError(f"{kind} rows of {cols} weights: the kernels need a multiple of 64")
        q, scale, mn = _unpack(kind, np.asarray(data, dtype=np.uint8).reshape(-1, nbytes))
        q = q.reshape(out, cols)
        if LAYOUT[kind] == "u4":
            chunks = q.astype(np.uint8).reshape(out, cols // 64, 2, 32)
            packed = torch.from_numpy(np.ascontiguousarray(chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(out, cols // 2))
            return cls(kind, packed, torch.from_numpy(scale.reshape(out, -1).astype(np.float32)),
                       torch.from_numpy(mn.reshape(out, -1).astype(np.float32)))
        return cls(kind, torch.from_numpy(q.astype(np.int8)), torch.from_numpy(scale.reshape(out, -1).astype(np.float32)), None)

    def values(self) -> torch.Tensor:
        """[out, in] the integer values q, in k order."""
        if self.layout == "i8":
            return self.q.to(torch.int32)
        out = self.q.shape[0]
        chunks = self.q.view(out, -1, 1, 32)
        return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(out, -1).to(torch.int32)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[out, in] (or the given ``rows``) as ggml dequantizes them, in ``dtype``."""
        w = self if rows is None else self.select(rows)
        group = 32 if w.layout == "u4" else 16
        q = w.values().float().view(w.q.shape[0], -1, group)
        deq = q * w.scale[:, :, None]
        if w.min is not None:
            deq = deq - w.min[:, :, None]
        return deq.reshape(w.q.shape[0], -1).to(dtype)

    def select(self, rows: torch.Tensor) -> "BlockWeight":
        """The given output rows (a permutation, or an embedding lookup)."""
        return BlockWeight(self.ggml_type, self.q[rows].contiguous(), self.scale[rows].contiguous(),
                           None if self.min is None else self.min[rows].contiguous())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, in] @ w.T (+ bias) -> [n, out] in x's dtype."""
        module = block_linear() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None
        if module is None:
            return torch.nn.functional.linear(x, self.dequantize(x.dtype).to(x.device), bias)
        if self.layout == "u4":
            return module.linear_u4(x, self.q, self.scale, self.min, bias)
        return module.linear_i8(x, self.q, self.scale, bias)

    def to(self, device) -> "BlockWeight":
        return BlockWeight(self.ggml_type, self.q.to(device), self.scale.to(device),
                           None if self.min is None else self.min.to(device))

    # -- the conversion cache stores each part as its own tensor ----------------------------
    def parts(self, name: str) -> dict[str, torch.Tensor]:
        out = {f"{name}::q": self.q, f"{name}::scale": self.scale}
        return out | ({f"{name}::min": self.min} if self.min is not None else {})

    @classmethod
    def from_parts(cls, ggml_type: str, name: str, tensors: dict[str, torch.Tensor]) -> "BlockWeight":
        return cls(ggml_type, tensors[f"{name}::q"], tensors[f"{name}::scale"], tensors.get(f"{name}::min"))
