"""Training Medusa heads (Cai et al. 2024, Medusa-1: the target frozen, only the heads learn).

Head k reads the target's final hidden state at index i and learns the target's distribution at
position i + 1 + k (the token i + 2 + k), over the draft vocabulary: a soft cross-entropy,
weighted ``decay ** k`` (the paper's 0.8^k: later heads are harder and matter less, since a chain
is only as long as its first rejection)."""

from __future__ import annotations

from pathlib import Path

import torch

from quickdraft.models import medusa as head_file
from quickdraft.models.eagle3 import target_key
from quickdraft.proposers.heads.common import target_name
from quickdraft.train.loop import data_vocab, fit, head_rows, soft_cross_entropy


def medusa_loss(heads: "head_file.MedusaHeads", lm_rows: torch.Tensor, batch, decay: float = 0.8):
    """batch: aux, final [B, T, H], tokens, lengths [B] -> (loss, {acc0, acc1, ..})."""
    _, final, _, lengths = batch
    T = final.shape[1]
    with torch.no_grad():
        target = torch.softmax(final @ lm_rows.T, dim=-1)  # [B, T, N]
    logits = heads(final)  # [B, T, K, N]
    idx = torch.arange(T)
    total, metrics, weights = 0.0, {}, 0.0
    for k in range(heads.config.num_heads):
        goal = torch.roll(target, -(k + 1), dims=1)
        valid = idx.view(1, -1) <= (lengths.view(-1, 1) - 2 - k)
        total = total + decay**k * soft_cross_entropy(logits[:, :, k], goal, valid)
        weights += decay**k
        with torch.no_grad():
            hit = (logits[:, :, k].argmax(-1) == goal.argmax(-1)) & valid
            metrics[f"acc{k}"] = float(hit.sum() / valid.sum().clamp(min=1))
    return total / weights, metrics


def train(model, windows, out_dir: str | Path, steps: int = 2000, num_heads: int = 4, draft_vocab_size: int = 32768,
          batch_size: int = 4, lr: float = 1e-3, seed: int = 0, progress: bool = True,
          extra: dict | None = None, mixed: bool = True) -> tuple["head_file.MedusaHeads", list[float]]:
    """Train K heads for ``model`` on ``windows`` and save them (vLLM's Medusa layout) into ``out_dir``."""
    out = Path(out_dir)
    ids = data_vocab(windows, model, draft_vocab_size)
    c = model.config
    config = head_file.MedusaConfig(c.hidden_size, c.vocab_size, num_heads, ids.numel(), target_name(model), target_key(model))
    torch.manual_seed(seed)
    heads = head_file.MedusaHeads(config, ids)
    head_file.init_from_target(heads, model)
    lm_rows = head_rows(model, ids)
    losses = fit(heads, lambda b: medusa_loss(heads, lm_rows, b), windows, steps, batch_size, lr,
                 out / "checkpoint.pt", f"training {num_heads} Medusa heads", seed, progress, mixed=mixed)
    head_file.save(heads, out, extra={"steps": steps, "windows": len(windows),
                                      "tokens": sum(len(w.tokens) for w in windows), **(extra or {})})
    return heads, losses
