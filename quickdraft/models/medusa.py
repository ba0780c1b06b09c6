"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads") and their files.

From the target's final hidden state h_t (after its norm; the target's own head reads it to
predict token t + 1), head k (0-based) predicts token t + 2 + k: a residual SiLU block
``h + silu(W_k h + b_k)`` and an output head over a draft vocabulary of N target tokens (each
head its own rows, started from the target's). K heads draft a chain of K tokens from one state.

Files: vLLM's Medusa layout. ``config.json``: ``model_type: "medusa"``, ``architectures:
["MedusaModel"]``, ``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers`` (residual
blocks a head), ``truncated_vocab_size``, ``medusa_fc_bias``; ``model.safetensors``:
``blocks.{k}.layers.{j}.weight`` / ``.bias``, ``lm_heads.{k}.weight`` and, for a truncated
vocabulary, ``token_map`` (the target id of each row). A ``quickdraft`` key declares the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.errors import ConfigError
from quickdraft.models import head_dir
from quickdraft.models.eagle3 import check_head_target


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int  # the target's
    num_heads: int  # K
    draft_vocab_size: int  # N rows of each lm_head
    target: str
    target_key: str | None = None
    num_layers: int = 1  # residual blocks a head


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig, draft_ids: torch.Tensor):
        super().__init__()
        self.config = c = config
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(c.hidden_size, c.hidden_size) for _ in range(c.num_layers))
                                    for _ in range(c.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False) for _ in range(c.num_heads))
        for block in self.blocks:  # each block starts as the identity: the target's prediction, shifted
            for layer in block:
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)
        self.register_buffer("draft_ids", draft_ids.long().clone(), persistent=False)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [..., heads, N] float32 of the first ``num_heads`` heads."""
        out = []
        for block, lm in list(zip(self.blocks, self.lm_heads))[: num_heads or self.config.num_heads]:
            x = hidden
            for layer in block:
                x = x + F.silu(layer(x))
            out.append(lm(x).float())
        return torch.stack(out, dim=-2)

    def named(self) -> dict[str, nn.Parameter]:
        """The parameters by their names in vLLM's layout."""
        w = {}
        for k, block in enumerate(self.blocks):
            for j, layer in enumerate(block):
                w[f"blocks.{k}.layers.{j}.weight"] = layer.weight
                w[f"blocks.{k}.layers.{j}.bias"] = layer.bias
            w[f"lm_heads.{k}.weight"] = self.lm_heads[k].weight
        return w

    def state(self) -> dict[str, torch.Tensor]:
        w = {k: v.detach().contiguous() for k, v in self.named().items()}
        if self.config.draft_vocab_size < self.config.vocab_size:
            w["token_map"] = self.draft_ids.cpu()
        return w


def init_from_target(heads: MedusaHeads, model) -> None:
    w = model.weights
    lm = w["model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"]
    if not isinstance(lm, torch.Tensor):
        lm = lm.dequantize(torch.float32)
    rows = lm[heads.draft_ids.to(lm.device)].float()
    with torch.no_grad():
        for head in heads.lm_heads:
            head.weight.copy_(rows)


def save(heads: MedusaHeads, path: str | Path, extra: dict | None = None) -> Path:
    c = heads.config
    doc = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": c.hidden_size,
           "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
           "truncated_vocab_size": c.draft_vocab_size, "medusa_fc_bias": True, "original_lm_head": False,
           "quickdraft": {"target": c.target, "target_key": c.target_key, **(extra or {})}}
    return head_dir.save(path, heads.state(), doc)


def load(path: str | Path) -> MedusaHeads:
    path = Path(path)
    doc, w = head_dir.load(path, "Medusa heads")
    if doc.get("model_type") != "medusa":
        raise ConfigError(f"{path} does not hold Medusa heads (model_type {doc.get('model_type')!r})")
    w = {k.removeprefix("medusa_heads."): v for k, v in w.items()}
    ours = doc.get("quickdraft", {})
    n = doc.get("truncated_vocab_size") or doc["vocab_size"]
    config = MedusaConfig(doc["hidden_size"], doc["vocab_size"], doc["num_heads"], n, ours.get("target", ""),
                          ours.get("target_key"), doc.get("num_hidden_layers", 1))
    ids = w["token_map"].long() if "token_map" in w else torch.arange(config.vocab_size)
    heads = MedusaHeads(config, ids)
    if doc.get("original_lm_head") and "lm_heads.0.weight" in w:  # one head shared by all
        w.update({f"lm_heads.{k}.weight": w["lm_heads.0.weight"] for k in range(config.num_heads)})
    own = heads.named()
    missing = [k for k in own if k not in w]
    if missing:
        raise ConfigError(f"the Medusa heads at {path} lack {missing[:3]}")
    with torch.no_grad():
        for name, p in own.items():
            if tuple(w[name].shape) != tuple(p.shape):
                raise ConfigError(f"the Medusa heads' {name} has shape {tuple(w[name].shape)}, the config says {tuple(p.shape)}")
            p.copy_(w[name])
    return heads.eval()


def check_target(config: MedusaConfig, model, source: str) -> None:
    check_head_target("the Medusa heads", config, model, source)
