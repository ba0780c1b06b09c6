"""GGUF block-quantized weights kept as stored, repacked once at load for the CPU kernels.

A CPU decoding step reads every weight once, so its cost is the bytes read: a Q4_K_M file's
weights are ~4.6 bits each where bfloat16 is 16. ``BlockWeight`` holds a projection [out, in] as
one uint8 tensor [tiles, tile bytes] in the layout kernels/blocks.cpp multiplies (described
there): a tile is 16 weight rows, and lane l of every 64-byte vector belongs to row l of the
tile, so that one VNNI instruction serves 16 rows at once against 4 bytes of x broadcast, and
the scales follow each block, as compact as the file's. Every format dequantizes exactly as
ggml does:

- 4-bit values: Q4_0 (4.5 bits a weight, as the file), Q4_1 (5, as the file), Q4_K (4.625; the
  file's 4.5 packs the 6-bit scales tighter);
- 5- and 6-bit values: Q5_0 (5.5, as the file), Q6_K (6.5625, as the file);
- 8-bit values: Q8_0 (8.5, as the file).

The kernels quantize each row of activations to int8 per block (ggml's Q8_0 for 32-blocks), so
a product is not the float product with the dequantized weights; it is close (tested), and batch
invariant bit for bit. Where the kernels are missing (another CPU, CUDA, ``QUICKDRAFT_KERNELS=0``)
``linear`` dequantizes each matrix once, keeps it, and uses torch: correct, more memory, and
not invariant.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from quickdraft.kernels import block_linear

# type name -> (weights per block, bytes per block) in the file
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q4_K": (256, 144),
          "Q6_K": (256, 210)}

LANES = 16  # weight rows a tile: one per int32 lane of a 64-byte vector


@dataclass(frozen=True)
class Format:
    """How blocks.cpp stores one GGUF type (its ``Format<KIND>``): ``w = scale * (q - offset) - min``
    with q unsigned, one scale per ``block`` weights."""

    kind: int  # blocks.cpp's Kind
    block: int  # weights a scale
    bits: int  # 4, 5, 6 or 8: the stored values
    offset: int  # taken off the stored values
    scales: str  # "f16": a float16 scale (and min) a block; "k": int scales a block, float16 d a super-block
    has_min: bool
    super_block: int = 0  # blocks a super-block ("k" scales)

    @property
    def steps(self) -> int:
        """4-weight steps a block: one vpdpbusd each."""
        return self.block // 4

    @property
    def vectors(self) -> int:
        """64-byte vectors of values a block: 8-bit one a step; 4-bit two steps a vector (nibbles);
        5- and 6-bit the nibbles, then one vector of the high bits of every step."""
        return self.steps if self.bits == 8 else self.steps // 2 + (self.bits > 4)

    def block_fields(self) -> list[tuple[str, np.dtype]]:
        """The fields after each block's values, 16 lanes of each."""
        if self.scales == "f16":
            return [("scale", np.float16)] + ([("min", np.float16)] if self.has_min else [])
        return [("sc", np.uint8 if self.has_min else np.int8)] + ([("mn", np.uint8)] if self.has_min else [])

    def super_fields(self) -> list[tuple[str, np.dtype]]:
        """The fields before each super-block's first block, 16 lanes of each."""
        if self.scales != "k":
            return []
        return [("d", np.float16)] + ([("dmin", np.float16)] if self.has_min else [])

    def block_bytes(self) -> int:
        return self.vectors * 64 + LANES * sum(np.dtype(t).itemsize for _, t in self.block_fields())

    def super_bytes(self) -> int:
        return LANES * sum(np.dtype(t).itemsize for _, t in self.super_fields())

    def tile_bytes(self, k: int) -> int:
        """Bytes of a tile of 16 rows of k weights."""
        blocks = k // self.block
        supers = blocks // self.super_block if self.super_block else 0
        return blocks * self.block_bytes() + supers * self.super_bytes()


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
    and "d", "dmin" (float16, a super-block), as ggml's dequantize_row_* reads them."""
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
        return {"q": q, "sc": sc, "mn": mn, "d": _f16(blocks[:, 0:2]), "dmin": _f16(blocks[:, 2:4])}
    if kind == "Q6_K":
        ql, qh = blocks[:, 0:128], blocks[:, 128:192]
        halves = []
        for h in range(2):  # each half of 128 weights: 64 bytes of ql, 32 of qh
            lo, hi = ql[:, 64 * h : 64 * h + 64], qh[:, 32 * h : 32 * h + 32]
            halves += [(lo[:, :32] & 0x0F) | ((hi & 3) << 4), (lo[:, 32:] & 0x0F) | (((hi >> 2) & 3) << 4),
                       (lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4), (lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4)]
        return {"q": np.concatenate(halves, axis=1), "sc": blocks[:, 192:208].view(np.int8),
                "d": _f16(blocks[:, 208:210])}
    raise ValueError(f"no block layout for {kind}")


def _pack(f: Format, fields: dict[str, np.ndarray], out: int, k: int) -> np.ndarray:
    """The fields of [out, k] weights (each [out, per row]) -> [tiles, tile bytes] (blocks.cpp's
    layout). Rows past ``out`` in the last tile are zero weights."""
    tiles, blocks = -(-out // LANES), k // f.block
    pad = tiles * LANES - out

    def lanes(a: np.ndarray) -> np.ndarray:  # [out, n, ...] -> [tiles, n, ..., 16 lanes, ...]: rows to lanes
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        a = a.reshape(tiles, LANES, *a.shape[1:])
        return np.moveaxis(a, 1, 3 if a.ndim == 5 else 2)

    steps = lanes(fields["q"].reshape(out, blocks, f.steps, 4))  # [tile, block, step, lane, 4]
    half = f.steps // 2
    if f.bits == 8:
        values = steps
    else:  # step s in the low nibble, s + steps/2 in the high one; then the high bits of every step
        values = (steps[:, :, :half] & 0x0F) | ((steps[:, :, half:] & 0x0F) << 4)
        if f.bits > 4:
            width = f.bits - 4  # step s's high bits at bits width*s
            high = sum((steps[:, :, s] >> 4).astype(np.uint8) << (width * s) for s in range(f.steps))
            values = np.concatenate([values, high[:, :, None].astype(np.uint8)], axis=2)
    parts = [values.astype(np.uint8).reshape(tiles, blocks, -1)]
    for name, dtype in f.block_fields():
        part = lanes(fields[name].reshape(out, blocks).astype(dtype))  # [tile, block, lane]
        parts.append(np.ascontiguousarray(part).view(np.uint8).reshape(tiles, blocks, -1))
    records = np.concatenate(parts, axis=2)  # [tile, block, block bytes]
    if f.super_block:
        supers = blocks // f.super_block
        head = [np.ascontiguousarray(lanes(fields[n].reshape(out, supers).astype(t))).view(np.uint8).reshape(tiles, supers, -1)
                for n, t in f.super_fields()]
        records = np.concatenate(head + [records.reshape(tiles, supers, -1)], axis=2)
    return np.ascontiguousarray(records.reshape(tiles, -1))


def _fields(f: Format, data: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """[tiles, tile bytes] -> the fields of its tiles * 16 rows (``_pack``'s inverse): "q" [rows, k]
    unsigned, the block fields [rows, blocks], the super-block fields [rows, supers]."""
    tiles, blocks = data.shape[0], k // f.block

    def rows(a: np.ndarray) -> np.ndarray:  # [tile, n, ..., lane, ...] -> [tile * 16, n, ...]
        a = np.moveaxis(a, 3 if a.ndim == 5 else 2, 1)
        return a.reshape(tiles * LANES, *a.shape[2:])

    if f.super_block:
        supers = blocks // f.super_block
        data = data.reshape(tiles, supers, -1)
        out, at = {}, 0
        for name, dtype in f.super_fields():
            n = LANES * np.dtype(dtype).itemsize
            out[name] = rows(np.ascontiguousarray(data[:, :, at : at + n]).view(dtype)).reshape(tiles * LANES, supers)
            at += n
        records = data[:, :, at:].reshape(tiles, blocks, -1)
    else:
        out, records = {}, data.reshape(tiles, blocks, -1)
    nv = f.vectors * 64
    values = records[:, :, :nv].reshape(tiles, blocks, f.vectors, LANES, 4)
    half = f.steps // 2
    if f.bits == 8:
        steps = values
    else:
        steps = np.concatenate([values[:, :, :half] & 0x0F, values[:, :, :half] >> 4], axis=2)
        if f.bits > 4:
            width = f.bits - 4
            high = values[:, :, half]
            steps = steps | np.stack([((high >> (width * s)) & ((1 << width) - 1)) << 4 for s in range(f.steps)], axis=2)
    out["q"] = rows(steps).reshape(tiles * LANES, k)
    at = nv
    for name, dtype in f.block_fields():
        n = LANES * np.dtype(dtype).itemsize
        out[name] = rows(np.ascontiguousarray(records[:, :, at : at + n]).view(dtype)).reshape(tiles * LANES, blocks)
        at += n
    return out


def _dequantize(f: Format, fields: dict[str, np.ndarray]) -> np.ndarray:
    """The fields of n rows -> [n, k] float32, as ggml dequantizes them."""
    q = fields["q"].astype(np.float32) - f.offset
    n = q.shape[0]
    if f.scales == "f16":
        scale = fields["scale"].astype(np.float32)
        mn = fields["min"].astype(np.float32) if f.has_min else None
    else:
        scale = fields["sc"].astype(np.float32) * np.repeat(fields["d"].astype(np.float32), f.super_block, axis=1)
        mn = fields["mn"].astype(np.float32) * np.repeat(fields["dmin"].astype(np.float32), f.super_block, axis=1) if f.has_min else None
    deq = q.reshape(n, -1, f.block) * scale[:, :, None]
    if mn is not None:
        deq = deq - mn[:, :, None]
    return deq.reshape(n, -1)


def bits(kind: str) -> float:
    """Bits a weight of a GGUF block format, as the file stores it."""
    per_block, nbytes = BLOCKS[kind]
    return nbytes * 8 / per_block


def requantize(w: "BlockWeight | torch.Tensor", kind: str) -> "BlockWeight":
    """A matrix [out, in] (blocks of another format, or dense) quantized again into ``kind`` blocks
    by gguf's own quantizer (ggml's reference rounding; about 0.4 GB of float32 input a second)."""
    import gguf.quants  # only here: the loader's path does not need it

    dense = w.dequantize(torch.float32) if isinstance(w, BlockWeight) else w.detach().float()
    raw = gguf.quants.quantize(dense.cpu().numpy(), gguf.GGMLQuantizationType[kind])
    return BlockWeight.from_gguf(kind, raw, tuple(dense.shape)).to(w.device)


def wider(w, kind: str) -> bool:
    """Whether matrix ``w`` (blocks, or a dense 2-D weight that splits into ``kind``'s blocks) takes
    more bits a weight than ``kind``."""
    if isinstance(w, BlockWeight):
        return bits(w.ggml_type) > bits(kind)
    return isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] % BLOCKS[kind][0] == 0


def requantize_wider(weights: dict, kind: str, progress: bool = True) -> dict:
    """``weights`` with every matrix that takes more bits a weight than ``kind`` quantized again
    into ``kind`` (``requantize``), the embedding and output head included; the rest as it is."""
    from tqdm import tqdm

    names = [n for n, w in weights.items() if wider(w, kind)]
    return weights | {n: requantize(weights[n], kind) for n in tqdm(names, desc=f"to {kind}", leave=False, disable=not progress)}


def on_blocks(weights) -> bool:
    """Whether a model's weights (a dict by name) hold any matrix kept in its GGUF blocks."""
    return any(isinstance(w, BlockWeight) for w in weights.values())


_WARNED: set = set()


def _warn_dense_once(w: "BlockWeight", dense: torch.Tensor) -> None:
    """One line per device and dtype: GGUF blocks running dequantized, and what that costs."""
    key = (str(dense.device), dense.dtype)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"quickdraft: no GGUF block kernels for {dense.dtype} on {dense.device}: block matrices are "
                      f"dequantized once, on first use ({w.ggml_type} {tuple(w.shape)}: {w.nbytes / 2**20:.1f} MiB of "
                      f"blocks -> {dense.numel() * dense.element_size() / 2**20:.1f} MiB dense)", stacklevel=4)


@dataclass
class BlockWeight:
    """A projection [out, in] in a GGUF block format, repacked for kernels/blocks.cpp."""

    ggml_type: str  # the file's type: "Q4_K", "Q6_K", ...
    data: torch.Tensor  # [tiles, tile bytes] uint8: 16 rows a tile (see blocks.cpp)
    in_features: int
    out_features: int
    _dense: dict = field(default_factory=dict, repr=False, compare=False)  # dtype -> dequantized copy (no kernels)

    @property
    def format(self) -> Format:
        return FORMATS[self.ggml_type]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

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
        return cls.from_fields(kind, {n: a.reshape(out, -1) for n, a in fields.items()}, cols)

    @classmethod
    def from_fields(cls, kind: str, fields: dict[str, np.ndarray], k: int) -> "BlockWeight":
        out = fields["q"].shape[0]
        return cls(kind, torch.from_numpy(_pack(FORMATS[kind], fields, out, k)), k, out)

    def fields(self, rows: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        """The fields of the given rows (all by default), unpacking only the tiles that hold them."""
        f = self.format
        if rows is None:
            got = _fields(f, self.data.cpu().numpy(), self.in_features)
            return {n: a[: self.out_features] for n, a in got.items()}
        rows = rows.cpu().numpy().astype(np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.out_features):
            raise IndexError(f"rows out of range for {self.out_features} rows")
        tiles, where = np.unique(rows // LANES, return_inverse=True)
        got = _fields(f, self.data.cpu().numpy()[tiles], self.in_features)
        pick = where * LANES + rows % LANES
        return {n: a[pick] for n, a in got.items()}

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[out, in] (or the given ``rows``) as ggml dequantizes them, in ``dtype``."""
        deq = _dequantize(self.format, self.fields(rows))
        return torch.from_numpy(deq).to(device=self.device, dtype=dtype)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The matrix dequantized to ``dtype``, once (kept for the calls after)."""
        if dtype not in self._dense:
            dense = self.dequantize(dtype)
            _warn_dense_once(self, dense)
            self._dense[dtype] = dense
        return self._dense[dtype]

    def select(self, rows: torch.Tensor) -> "BlockWeight":
        """The given output rows (a permutation, or a truncated vocabulary), repacked."""
        picked = BlockWeight.from_fields(self.ggml_type, self.fields(rows), self.in_features)
        return picked.to(self.device)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, in] @ w.T (+ bias) -> [n, out] in x's dtype. Without the block kernels (CUDA, a CPU
        whose kernels did not build) the matrix is dequantized to x's dtype on the first call and
        kept: a dense copy beside the blocks, never a dequantization at every call."""
        module = block_linear() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None
        if module is None:
            return torch.nn.functional.linear(x, self.dense(x.dtype), bias)
        y = module.linear_blocks(x.contiguous(), self.data, self.format.kind, self.in_features, bias)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features].contiguous()

    def to(self, device) -> "BlockWeight":
        return BlockWeight(self.ggml_type, self.data.to(device), self.in_features, self.out_features)

    # -- the conversion cache stores each part as its own tensor ----------------------------
    def parts(self, name: str) -> dict[str, torch.Tensor]:
        return {f"{name}::data": self.data, f"{name}::shape": torch.tensor([self.out_features, self.in_features])}

    @classmethod
    def from_parts(cls, ggml_type: str, name: str, tensors: dict[str, torch.Tensor]) -> "BlockWeight":
        data, (out, k) = tensors[f"{name}::data"], (int(v) for v in tensors[f"{name}::shape"])
        f = FORMATS[ggml_type]
        if tuple(data.shape) != (-(-out // LANES), f.tile_bytes(k)):
            raise ValueError(f"{name}: records {tuple(data.shape)}, {ggml_type} [{out}, {k}] needs "
                             f"{(-(-out // LANES), f.tile_bytes(k))}")
        return cls(ggml_type, data, k, out)
