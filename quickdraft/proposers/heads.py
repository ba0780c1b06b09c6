"""What the trained-head proposers (EAGLE-3, Medusa) share: where a target's heads live, the error
for a missing one, the target's embedding rows, and sampling a head's draft tokens.

Heads live in the cache, ``$QUICKDRAFT_CACHE/heads/<target>/<method>/``, never in the repository;
``quickdraft train`` writes them there, and a speculative config's ``"model"`` names another
directory (a head trained elsewhere).
"""

from __future__ import annotations

from pathlib import Path

import torch

from quickdraft.errors import ConfigError
from quickdraft.proposers.draft_model import sample_draft, to_vocab
from quickdraft.sampling import BatchSampling, draw_uniforms


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


def sample_rows(seqs, logits: torch.Tensor, head_ids: torch.Tensor | None, vocab_size: int, sampled: bool):
    """logits [n, N] over a head's rows, one per sequence -> full-vocabulary ids [n] and q [n, V]
    (None when no sequence samples): the argmax for greedy requests, else a draw from q shaped by
    the request's temperature, top-k and top-p, with the request's own generator."""
    if not sampled:
        rows, q = logits.argmax(-1), None
    else:
        batch = BatchSampling.from_params([s.params for s in seqs], logits.device)
        uniforms = torch.stack([draw_uniforms(s.generator, 1)[0] for s in seqs]).to(logits.device)
        rows, q = sample_draft(logits, batch, uniforms)
    return to_vocab(rows, q, head_ids, vocab_size)
