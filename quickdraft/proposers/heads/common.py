"""What the trained-head proposers (EAGLE-3, Medusa) share: where a target's heads live, the error
for a missing one, the target's embedding rows, sampling a head's draft tokens, and serving a
head's matrices from GGUF blocks.

Heads live in the cache, ``$QUICKDRAFT_CACHE/heads/<target>/<method>/``, never in the repository;
``quickdraft train`` writes them there, and a speculative config's ``"model"`` names another
directory (a head trained elsewhere).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from quickdraft.errors import ConfigError
from quickdraft.proposers.draft_sampling import confident_rows, sample_draft, to_vocab
from quickdraft.sampling import BatchSampling, argmax_rows, draw_uniforms


def target_name(model) -> str:
    """The target's name as heads are filed under it: a built-in's name, else the file's stem."""
    return model.config.name or Path(str(model.source)).stem


def default_dir(model, method: str) -> Path:
    from quickdraft.models.registry import cache_dir

    return cache_dir() / "heads" / target_name(model) / method


def resolve_dir(spec, model, method: str) -> Path:
    """The head's directory: the config's ``"model"``, else the cache's for this target; a missing
    head is an error that prints the command that trains it."""
    path = Path(spec.model).expanduser() if spec.model else default_dir(model, method)
    if not (path / "config.json").is_file():
        what = f"no {method} head at {path}" if spec.model else f"no {method} head has been trained for {target_name(model)!r}"
        raise ConfigError(f"{what}; train one with: quickdraft train {method} --model {target_name(model)} "
                          f"(or give a trained head's directory as \"model\")", "model")
    return path


def embed_rows(weights: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The target's embedding rows of ``tokens`` [n] -> [n, hidden] float32 (GGUF blocks dequantized)."""
    embed = weights["model.embed_tokens.weight"]
    if isinstance(embed, torch.Tensor):
        return embed[tokens.to(embed.device)].float()
    return embed.dequantize(torch.float32, rows=tokens)


def sample_rows(seqs, logits: torch.Tensor, head_ids: torch.Tensor | None, vocab_size: int, sampled: bool,
                threshold: float = 0.0):
    """logits [n, N] over a head's rows, one per sequence -> full-vocabulary ids [n], q [n, V]
    (None when no sequence samples), and [n] whether the head's own probability of each token
    clears ``threshold`` (draft_sampling.confident_rows): the argmax for greedy requests, else a draw
    from q shaped by the request's temperature, top-k and top-p, with the request's own generator."""
    if not sampled:
        rows, q = argmax_rows(logits), None
    else:
        batch = BatchSampling.from_params([s.params for s in seqs], logits.device)
        uniforms = torch.stack([draw_uniforms(s.generator, 1)[0] for s in seqs]).to(logits.device)
        rows, q = sample_draft(logits, batch, uniforms)
    confident = confident_rows(logits, rows, threshold)
    return (*to_vocab(rows, q, head_ids, vocab_size), confident)


# A head trains in float32, and a draft step reads all of its matrices: the 1.5B's EAGLE-3 head
# (fc, one decoder layer with its 8960-wide MLP, a 16384-row output head) is about 80M weights,
# 330 MB in float32, a third of what the target's own Q4_K_M pass reads. Served from GGUF blocks
# on the CPU's kernels (models/ggml.py) it reads a quarter of that (Q8_0) or less (Q4_0).
# Losslessness does not depend on it: the verifier gets the q the head really drafted from.
HEAD_BLOCKS = {"auto": "Q8_0", "int8": "Q8_0", "q4_0": "Q4_0"}


class BlockLinear(nn.Module):
    """An ``nn.Linear`` served from GGUF blocks: the same call, any leading dimensions, float32 out."""

    def __init__(self, linear: nn.Linear, kind: str):
        from quickdraft.models.ggml import requantize

        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = requantize(linear.weight.detach().float().cpu(), kind)
        self.bias = None if linear.bias is None else linear.bias.detach().float().cpu()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight.linear(x.reshape(-1, self.in_features).float().contiguous(), self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def serving_head(module: nn.Module, quantization: str | None, device) -> nn.Module:
    """A head ready to draft: float32 on ``device``, its matrices in GGUF blocks where the
    config asks for them (``HEAD_BLOCKS``; "auto": Q8_0 where the CPU's block kernels run, else
    float32). The trained module is copied, never changed."""
    from quickdraft.models.ggml import BLOCKS
    from quickdraft.kernels import block_linear

    kind = HEAD_BLOCKS.get(quantization) if quantization is not None else None
    runs = torch.device(device).type == "cpu" and block_linear() is not None
    if kind is not None and quantization != "auto" and not runs:
        raise ConfigError(f"quantization {quantization!r} serves the head from GGUF blocks on the CPU's kernels, "
                          f"which device {str(device)!r} does not have; leave it out", "quantization")
    module = copy.deepcopy(module).to(device).float().eval()
    if kind is None or not runs:
        return module
    block = BLOCKS[kind][0]
    for name, child in list(module.named_modules()):
        if isinstance(child, nn.Linear) and child.in_features % block == 0:
            parent, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, leaf, BlockLinear(child, kind))
    return module


def head_bytes(module: nn.Module) -> int:
    """Bytes a pass over every matrix of a serving head reads: its blocks and its float parameters."""
    blocks = [m for m in module.modules() if isinstance(m, BlockLinear)]
    return sum(p.numel() * p.element_size() for p in module.parameters()) + sum(
        m.weight.nbytes + (0 if m.bias is None else m.bias.numel() * 4) for m in blocks)
