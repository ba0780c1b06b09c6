"""GGUF block-quantized weights kept as stored, repacked once at load for the CPU kernels.

A CPU decoding step reads every weight once, so its cost is the bytes read: a Q4_K_M file's
weights are ~4.8 bits each where bfloat16 is 16. ``BlockWeight`` holds a projection as one uint8
tensor of records in the layout kernels/blocks.cpp multiplies (described there): per group of 16
blocks, the block values interleaved so that one VNNI instruction serves 16 blocks at once, then
the group's scales, as compact as the file's. Every format dequantizes exactly as ggml does:

- 4-bit values: Q4_0 (4.5 bits a weight, as the file), Q4_1 (5, as the file), Q4_K (4.75; the
  file's 4.5 packs the 6-bit scales tighter);
- 5- and 6-bit values: Q5_0 (5.5, as the file), Q6_K (6.625; 6.56 in the file);
- 8-bit values: Q8_0 (8.5, as the file).

The kernels quantize each row of activations to int8 per block (ggml's Q8_0 for 32-blocks), so
a product is not the float product with the dequantized weights; it is close (tested), and batch
invariant bit for bit. Where the kernels are missing (another CPU, CUDA, ``QUICKDRAFT_KERNELS=0``)
``linear`` dequantizes and uses torch: correct, slower, and not invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from quickdraft.models.kernels import block_linear

# type name -> (weights per block, bytes per block) in the file
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q4_K": (256, 144),
          "Q6_K": (256, 210)}


@dataclass(frozen=True)
class Format:
    """How blocks.cpp stores one GGUF type (its ``Format<KIND>``): ``w = scale * (q - offset) - min``
    with q unsigned, one scale per ``block`` weights."""

    kind: int  # blocks.cpp's Kind
    block: int  # weights a scale
    bits: int  # 4, 5, 6 or 8: the stored values
    offset: int  # taken off the stored values
    scales: str  # "f16": a float16 scale (and min) a block; "k": int scales a block, float d a super-block
    has_min: bool
    super_block: int = 0  # blocks a super-block ("k" scales)

    def record(self, g: int) -> int:
        """Bytes of a record of g blocks: the values, then the scale fields (``_field_order``)."""
        fields = sum(np.dtype(dtype).itemsize * g // per for _, dtype, per in _field_order(self))
        return self.block * g * self.bits // 8 + fields

    def row_bytes(self, k: int) -> int:
        blocks = k // self.block
        full, tail = divmod(blocks, 16)
        return full * self.record(16) + (self.record(tail) if tail else 0)


FORMATS = {
    "Q4_0": Format(0, 32, 4, 8, "f16", False),
    "Q4_1": Format(1, 32, 4, 0, "f16", True),
    "Q4_K": Format(2, 32, 4, 0, "k", True, super_block=8),
    "Q8_0": Format(3, 32, 8, 128, "f16", False),
    "Q5_0": Format(4, 32, 5, 16, "f16", False),
    "Q6_K": Format(5, 16, 6, 32, "k", False, super_block=16),
}


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n] float16 (little-endian)."""
    return np.ascontiguousarray(b).view(np.float16).reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] values: the low nibbles, then the high ones (ggml's Q4_0 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _unpack(kind: str, blocks: np.ndarray) -> dict[str, np.ndarray]:
    """[file blocks, bytes] -> the fields of ``FORMATS[kind]``, flat in k order: "q" (the stored
    unsigned values, q + offset), and "scale" and "min" (float16, a block) or "sc", "mn" (a block)
    and "d", "dmin" (float32, a super-block), as ggml's dequantize_row_* reads them."""
    if kind in ("Q4_0", "Q4_1"):
        if kind == "Q4_0":
            return {"q": _nibbles(blocks[:, 2:18]), "scale": _f16(blocks[:, 0:2])}
        return {"q": _nibbles(blocks[:, 4:20]), "scale": _f16(blocks[:, 0:2]), "min": -_f16(blocks[:, 2:4])}
    if kind == "Q8_0":
        return {"q": blocks[:, 2:34] ^ 0x80, "scale": _f16(blocks[:, 0:2])}  # int8 + 128
    if kind == "Q5_0":
        qh = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32).reshape(-1, 1)
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # [n, 32]
        return {"q": _nibbles(blocks[:, 6:22]) | high, "scale": _f16(blocks[:, 0:2])}
    if kind == "Q4_K":
        s = blocks[:, 4:16]  # 8 six-bit scales and mins, packed in 12 bytes
        sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
        mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
        qs = blocks[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 64 weights: low nibbles, then high
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
        return {"q": q, "sc": sc, "mn": mn, "d": _f16(blocks[:, 0:2]).astype(np.float32),
                "dmin": _f16(blocks[:, 2:4]).astype(np.float32)}
    if kind == "Q6_K":
        ql, qh = blocks[:, 0:128], blocks[:, 128:192]
        halves = []
        for h in range(2):  # each half of 128 weights: 64 bytes of ql, 32 of qh
            lo, hi = ql[:, 64 * h : 64 * h + 64], qh[:, 32 * h : 32 * h + 32]
            halves += [(lo[:, :32] & 0x0F) | ((hi & 3) << 4), (lo[:, 32:] & 0x0F) | (((hi >> 2) & 3) << 4),
                       (lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4), (lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4)]
        return {"q": np.concatenate(halves, axis=1), "sc": blocks[:, 192:208].view(np.int8),
                "d": _f16(blocks[:, 208:210]).astype(np.float32)}
    raise ValueError(f"no block layout for {kind}")


def _field_order(f: Format) -> list[tuple[str, np.dtype, int]]:
    """The scale fields of a record, in order: (name, dtype, blocks per element)."""
    if f.scales == "f16":
        return [("scale", np.float16, 1)] + ([("min", np.float16, 1)] if f.has_min else [])
    sc = [("sc", np.uint8 if f.has_min else np.int8, 1)] + ([("mn", np.uint8, 1)] if f.has_min else [])
    return sc + [("d", np.float32, f.super_block)] + ([("dmin", np.float32, f.super_block)] if f.has_min else [])


def _groups(f: Format, k: int):
    """(first block, blocks) of each group of a row."""
    blocks = k // f.block
    return [(b, min(16, blocks - b)) for b in range(0, blocks, 16)]


def _pack(f: Format, fields: dict[str, np.ndarray], out: int, k: int) -> np.ndarray:
    """The fields of [out, k] weights -> [out, row_bytes] records (blocks.cpp's layout)."""
    blocks = k // f.block
    q = fields["q"].reshape(out, blocks, f.block // 4, 4)  # [row, block, step, 4]
    per_row = {n: fields[n].reshape(out, -1) for n, _, _ in _field_order(f)}
    records = []
    for b, g in _groups(f, k):
        steps = q[:, b : b + g].transpose(0, 2, 1, 3)  # [row, step, lane, 4]
        if f.bits == 4:  # step 2p in the low nibble, 2p + 1 in the high one
            steps = steps[:, 0::2] | (steps[:, 1::2] << 4)
        elif f.bits == 5:  # the low nibbles as 4-bit values (steps 2p, 2p + 1), then the high bit of all 8
            low, high = steps & 0x0F, steps >> 4
            high = sum(high[:, s] << s for s in range(8)).astype(np.uint8)
            steps = np.concatenate([low[:, 0::2] | (low[:, 1::2] << 4), high[:, None]], axis=1)
        elif f.bits == 6:  # the low nibbles as 4-bit values of steps 0-1 and 2-3, then the high 2 bits of all 4
            low, high = steps & 0x0F, steps >> 4
            high = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
            steps = np.concatenate([low[:, 0::2] | (low[:, 1::2] << 4), high[:, None]], axis=1)
        records.append(steps.reshape(out, -1).astype(np.uint8))
        for name, dtype, per in _field_order(f):
            part = per_row[name][:, b // per : (b + g) // per]
            records.append(np.ascontiguousarray(part.astype(dtype)).view(np.uint8))
    return np.ascontiguousarray(np.concatenate(records, axis=1))


def _read(f: Format, data: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """[out, row_bytes] records -> (q - offset [out, k] int32, scale [out, blocks] float32, min or None)."""
    out = data.shape[0]
    qs, scales, mins = [], [], []
    at = 0
    for b, g in _groups(f, k):
        n = f.block * g * f.bits // 8
        v = data[:, at : at + n].reshape(out, -1, g, 4)  # [row, vector, lane, 4]
        if f.bits == 4:
            v = np.stack([v & 0x0F, v >> 4], axis=2).reshape(out, -1, g, 4)
        elif f.bits == 5:
            low = np.stack([v[:, :4] & 0x0F, v[:, :4] >> 4], axis=2).reshape(out, 8, g, 4)
            v = low | np.stack([((v[:, 4] >> s) & 1) << 4 for s in range(8)], axis=1)
        elif f.bits == 6:
            low = np.stack([v[:, :2] & 0x0F, v[:, :2] >> 4], axis=2).reshape(out, 4, g, 4)
            v = low | np.stack([((v[:, 2] >> (2 * s)) & 3) << 4 for s in range(4)], axis=1)
        qs.append(v.transpose(0, 2, 1, 3).reshape(out, g * f.block))
        at += n
        got = {}
        for name, dtype, per in _field_order(f):
            n = np.dtype(dtype).itemsize * g // per
            got[name] = np.ascontiguousarray(data[:, at : at + n]).view(dtype).astype(np.float32)
            at += n
        if f.scales == "f16":
            scales.append(got["scale"])
            mins.append(got.get("min"))
        else:
            scales.append(got["sc"] * np.repeat(got["d"], f.super_block, axis=1))
            mins.append(got["mn"] * np.repeat(got["dmin"], f.super_block, axis=1) if f.has_min else None)
    q = np.concatenate(qs, axis=1).astype(np.int32) - f.offset
    return q, np.concatenate(scales, axis=1), np.concatenate(mins, axis=1) if f.has_min else None


def on_blocks(weights) -> bool:
    """Whether a model's weights (a dict by name) hold any matrix kept in its GGUF blocks."""
    return any(isinstance(w, BlockWeight) for w in weights.values())


@dataclass
class BlockWeight:
    """A projection [out, in] in a GGUF block format, repacked for kernels/blocks.cpp."""

    ggml_type: str  # the file's type: "Q4_K", "Q6_K", ...
    data: torch.Tensor  # [out, row_bytes] uint8: the records (see blocks.cpp)
    in_features: int

    @property
    def format(self) -> Format:
        return FORMATS[self.ggml_type]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.in_features))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @classmethod
    def from_gguf(cls, kind: str, data: np.ndarray, shape: tuple[int, int]) -> "BlockWeight":
        """``data``: the tensor's raw bytes as stored; ``shape``: its torch shape [out, in]."""
        out, cols = shape
        per_block, nbytes = BLOCKS[kind]
        if cols % per_block:
            raise ValueError(f"{kind} rows of {cols} weights: not whole blocks of {per_block}")
        fields = _unpack(kind, np.asarray(data, dtype=np.uint8).reshape(-1, nbytes))
        return cls(kind, torch.from_numpy(_pack(FORMATS[kind], fields, out, cols)), cols)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[out, in] (or the given ``rows``) as ggml dequantizes them, in ``dtype``."""
        w = self if rows is None else self.select(rows)
        f = w.format
        q, scale, mn = _read(f, w.data.cpu().numpy(), w.in_features)
        deq = q.reshape(q.shape[0], -1, f.block).astype(np.float32) * scale[:, :, None]
        if mn is not None:
            deq = deq - mn[:, :, None]
        return torch.from_numpy(deq.reshape(q.shape[0], -1)).to(device=self.device, dtype=dtype)

    def select(self, rows: torch.Tensor) -> "BlockWeight":
        """The given output rows (a permutation, or an embedding lookup)."""
        return BlockWeight(self.ggml_type, self.data[rows.to(self.device)].contiguous(), self.in_features)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, in] @ w.T (+ bias) -> [n, out] in x's dtype."""
        module = block_linear() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None
        if module is None:
            return torch.nn.functional.linear(x, self.dequantize(x.dtype), bias)
        return module.linear_blocks(x.contiguous(), self.data, self.format.kind, self.in_features, bias)

    def to(self, device) -> "BlockWeight":
        return BlockWeight(self.ggml_type, self.data.to(device), self.in_features)

    # -- the conversion cache stores each part as its own tensor ----------------------------
    def parts(self, name: str) -> dict[str, torch.Tensor]:
        return {f"{name}::data": self.data, f"{name}::in": torch.tensor([self.in_features])}

    @classmethod
    def from_parts(cls, ggml_type: str, name: str, tensors: dict[str, torch.Tensor]) -> "BlockWeight":
        data, k = tensors[f"{name}::data"], int(tensors[f"{name}::in"][0])
        if data.shape[1] != FORMATS[ggml_type].row_bytes(k):
            raise ValueError(f"{name}: {data.shape[1]} bytes a row, {ggml_type} needs {FORMATS[ggml_type].row_bytes(k)}")
        return cls(ggml_type, data, k)
