"""Training an EAGLE-3 head with the training-time test (Li et al. 2025, section 3.2).

A window's positions are all trained at once, and the head is unrolled ``ttt_steps`` times:

- step 0 reads, at index i, the pair (fc(aux_i), embedding of x_{i+1}), the target's true
  features, and predicts x_{i+2};
- step j > 0 reads at index i the pair (its own step j - 1 output at i, embedding of x_{i+j+1})
  and predicts x_{i+j+2}: the head learns from its own features, as it drafts when serving.

Attention at step j, index i, sees step 0's keys at indices 0..i (the real context) and the keys
of steps 1..j at index i itself (its own draft chain), and every pair at step j, index i, sits at
position i + j: exactly what the proposer's cache holds when it drafts the (j + 1)-th token after
position i. The loss at each step is the soft cross-entropy against the target's distribution at
the predicted position, restricted to the draft vocabulary (recomputed from the stored final
hidden state), weighted ``decay ** j``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quickdraft.models import eagle3 as head_file
from quickdraft.proposers.heads.common import embed_rows
from quickdraft.train.loop import data_vocab, fit, head_rows, soft_cross_entropy


def unroll(head: "head_file.Eagle3Head", embed, aux: torch.Tensor, tokens: torch.Tensor, ttt_steps: int):
    """The head unrolled over whole windows: aux [B, T, 3H], tokens [B, T] -> logits [B, T, N]
    of each step j (at index i: the head's prediction of x_{i+j+2}), one step at a time."""
    B, T, _ = aux.shape
    c = head.config
    idx = torch.arange(T)
    group, scale = c.num_heads // c.num_kv_heads, c.head_dim**-0.5
    causal = idx.view(1, -1) <= idx.view(-1, 1)  # [T(query), T(key)]
    feature = head.fc(aux)
    keys, values = [], []  # steps 1..j: [B, heads, T, d], read on the diagonal only
    for j in range(ttt_steps):
        nxt = torch.roll(tokens, -(j + 1), dims=1)  # x_{i+j+1} at index i (the wrapped tail is masked)
        q, k, v, residual = head.project(embed(nxt), feature, (idx + j).expand(B, T))
        q = q.transpose(1, 2)  # [B, heads, T, d]
        k = k.repeat_interleave(group, dim=2).transpose(1, 2)
        v = v.repeat_interleave(group, dim=2).transpose(1, 2)
        if j == 0:
            keys0, values0 = k, v
        else:
            keys.append(k)
            values.append(v)
        scores = ((q @ keys0.transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))  # [B, heads, T, T]
        diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys]  # each [B, heads, T, 1]
        probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
        attn = probs[..., :T] @ values0
        for m, vv in enumerate(values):
            attn = attn + probs[..., T + m : T + m + 1] * vv
        out = head.finish(attn.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim), residual)
        yield head.logits(out)
        feature = out


def ttt_loss(head: "head_file.Eagle3Head", embed, lm_rows: torch.Tensor, batch, ttt_steps: int, decay: float = 0.8):
    """batch: aux [B, T, 3H], final [B, T, H], tokens [B, T], lengths [B]; embed: ids -> [.., H];
    lm_rows [N, H]: the target's head rows of the draft vocabulary. -> (loss, {acc0, acc1, ..}):
    acc j is how often step j's argmax is the target's (over the draft vocabulary)."""
    aux, final, tokens, lengths = batch
    T = aux.shape[1]
    with torch.no_grad():  # the target's next-token distribution at each position, over the draft vocabulary
        target = torch.softmax(final @ lm_rows.T, dim=-1)  # [B, T, N]
    idx = torch.arange(T)
    total, metrics = 0.0, {}
    for j, logits in enumerate(unroll(head, embed, aux, tokens, ttt_steps)):
        goal = torch.roll(target, -(j + 1), dims=1)  # the target at position i + j + 1
        valid = idx.view(1, -1) <= (lengths.view(-1, 1) - 2 - j)  # [B, T]
        total = total + decay**j * soft_cross_entropy(logits, goal, valid)
        with torch.no_grad():
            hit = (logits.argmax(-1) == goal.argmax(-1)) & valid
            metrics[f"acc{j}"] = float(hit.sum() / valid.sum().clamp(min=1))
    return total / sum(decay**j for j in range(ttt_steps)), metrics


def train(model, windows, out_dir: str | Path, steps: int = 2000, draft_vocab_size: int = 32768, ttt_steps: int = 3,
          batch_size: int = 4, lr: float = 1e-3, seed: int = 0, progress: bool = True,
          extra: dict | None = None, mixed: bool = True) -> tuple["head_file.Eagle3Head", list[float]]:
    """Train a head for ``model`` on ``windows`` (train/data.py) and save it into ``out_dir`` in the
    speculators format; ``out_dir/checkpoint.pt`` lets an interrupted run resume."""
    out = Path(out_dir)
    ids = data_vocab(windows, model, draft_vocab_size)
    torch.manual_seed(seed)
    head = head_file.Eagle3Head(head_file.Eagle3Config.for_target(model, ids.numel()), ids)
    head_file.init_from_target(head, model)
    lm_rows = head_rows(model, ids)
    embed = lambda t: embed_rows(model.weights, t.reshape(-1)).view(*t.shape, -1)  # noqa: E731
    losses = fit(head, lambda b: ttt_loss(head, embed, lm_rows, b, ttt_steps), windows, steps, batch_size, lr,
                 out / "checkpoint.pt", f"training EAGLE-3 head ({ttt_steps} TTT steps)", seed, progress, mixed=mixed)
    head_file.save(head, out, extra={"steps": steps, "ttt_steps": ttt_steps, "windows": len(windows),
                                     "tokens": sum(len(w.tokens) for w in windows), **(extra or {})})
    return head, losses
