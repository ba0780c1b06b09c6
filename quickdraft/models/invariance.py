"""Probing batch invariance on this machine (docs/design/batch-invariance.md), for ``quickdraft check``.

What the kernels promise is stated in ``kernels.invariance``; this module tests it, on the CPU at
hand and on a real model's shapes: every distinct projection the decoder runs, with 1 to
``max_rows`` rows, must give each row the bits it gets alone; and the whole decoder must give a
chain scored in chunks (as a verification pass does, beside another request) the logits of the
same tokens fed one by one (as plain decoding does).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from quickdraft.models.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder, linear
from quickdraft.kernels import int8_linear
from quickdraft.models.ggml import BlockWeight
from quickdraft.models.quant import Int8Weight

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
HEAD_ROWS = 8192  # the output head is probed on its first rows: every output row is computed alike


@dataclass
class ProbeResult:
    name: str  # "mlp.down_proj", "lm_head", "decoder"
    shape: tuple[int, int]  # (out, in); for "decoder": (tokens, chunk)
    path: str  # the kernel path, as kernels.invariance names it
    invariant: bool
    first_bad_rows: int | None  # the smallest row count whose rows differ from the rows alone
    max_abs_diff: float
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def _head_rows(w, n: int):
    if isinstance(w, BlockWeight):
        return w.select(torch.arange(min(n, w.shape[0])))
    if isinstance(w, Int8Weight):
        return Int8Weight(w.q[:n].contiguous(), w.scale[:n].contiguous(), w.qsum[:n].contiguous())
    return w[:n].contiguous()


def probe_linear(name: str, weight, bias, dtype: torch.dtype, path: str, max_rows: int = 64,
                 seed: int = 0) -> ProbeResult:
    """``linear`` on 1..max_rows rows against each row computed alone, bit for bit."""
    start = time.perf_counter()
    out_features, in_features = weight.shape
    device = weight.q.device if isinstance(weight, Int8Weight) else weight.device
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max_rows, in_features, generator=g).to(device=device, dtype=dtype)  # [max_rows, in]
    alone = torch.cat([linear(x[r : r + 1], weight, bias) for r in range(max_rows)])  # [max_rows, out]
    first_bad, diff = None, 0.0
    for n in range(1, max_rows + 1):
        got = linear(x[:n], weight, bias)
        if not torch.equal(got, alone[:n]):
            first_bad = first_bad or n
            diff = max(diff, (got.float() - alone[:n].float()).abs().max().item())
    return ProbeResult(name, (out_features, in_features), path, first_bad is None, first_bad, diff,
                       time.perf_counter() - start)


def probe_decoder(model: Decoder, num_tokens: int = 24, chunk: int = 7, seed: int = 0) -> ProbeResult:
    """A chain scored in chunks of ``chunk`` tokens beside another sequence, against the same
    tokens one by one: the logits must be equal bit for bit."""
    start = time.perf_counter()
    c = model.config
    tokens = torch.randint(0, c.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.to(model.device)
    kv = KVCache(c, 3, num_tokens + 1, model.dtype, model.device)
    one_by_one = []
    for i in range(num_tokens):
        meta = AttentionMetadata.chain([0], [i], [1])
        one_by_one.append(model.logits(model.forward(tokens[i : i + 1], meta.positions(model.device), kv, meta)))
    ref = torch.cat(one_by_one)  # [num_tokens, vocab]
    chunks, i = [], 0
    while i < num_tokens:
        n = min(chunk, num_tokens - i)
        meta = AttentionMetadata.chain([1, 2], [i, i], [n, 1])  # slot 2: another request's token
        batch = torch.cat([tokens[i : i + n], tokens[:1]])
        chunks.append(model.logits(model.forward(batch, meta.positions(model.device), kv, meta))[:n])
        i += n
    got = torch.cat(chunks)
    bad = (got != ref).any(dim=1).nonzero()
    return ProbeResult("decoder", (num_tokens, chunk), model.batch_invariance.path, bad.numel() == 0,
                       None if bad.numel() == 0 else int(bad[0]) + 1, (got - ref).abs().max().item(),
                       time.perf_counter() - start)


def _path(weight, model_path: str) -> str:
    if not isinstance(weight, Int8Weight):
        return model_path  # dense, or GGUF blocks: the model's path names which
    return "int8-vnni" if int8_linear() is not None else "torch-cpu"


def probe(model: Decoder, max_rows: int = 64) -> list[ProbeResult]:
    """Every distinct projection of ``model`` (shape, format and bias), its output head, and the
    whole decoder. Layers share their shapes, so layer 0 stands for all of them."""
    w, path = model.w, model.batch_invariance.path
    results, seen = [], set()
    for name in PROJECTIONS:
        weight, bias = w[f"model.layers.0.{name}.weight"], w.get(f"model.layers.0.{name}.bias")
        key = (tuple(weight.shape), type(weight), getattr(weight, "ggml_type", None), bias is not None)
        if key in seen:
            continue
        seen.add(key)
        results.append(probe_linear(name, weight, bias, model.dtype, _path(weight, path), max_rows))
    head = _head_rows(model.lm_head, HEAD_ROWS)
    results.append(probe_linear("lm_head", head, None, model.dtype, _path(head, path), max_rows))
    results.append(probe_decoder(model))
    return results
