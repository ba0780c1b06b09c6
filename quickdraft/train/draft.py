"""Distilling the draft model towards the target (``quickdraft train draft``).

The published recipe for a separate draft (DistillSpec, Zhou et al. 2024) is to fine-tune it on
the target's own distribution: here minimising KL(p_target || q_draft) at every position of the
windows ``quickdraft train data`` labelled (the target's p recomputed from the stored final hidden
state over the whole vocabulary), by a full fine-tune of every draft weight or by LoRA adapters
(Hu et al. 2022, through ``peft``) on the attention and MLP matrices, merged into them at the end.
The result is a Hugging Face directory (``config.json``, ``model.safetensors``, the tokenizer
files) that ``--speculative-config '{"method": "draft_model", "model": DIR}'`` loads like any draft.

A draft can be made cheaper first by dropping layers (``keep_layers``: the layers kept, in order),
then distilled back towards the target, the layer-dropping recipe of DistilBERT (Sanh et al.
2019) and of layer-pruned drafts: a draft pass costs about what its layers and head read, so
half the layers is a cheaper pass, and the distillation recovers what it can of the acceptance.
The saved directory has the kept layers only, renumbered from 0.

The training forward is a plain autograd one (torch ops, causal scaled-dot-product attention);
the engine's decoder, which serves the result, is inference-only. tests/train/test_draft.py
checks that the two agree on the logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft.errors import ConfigError, QuickdraftError
from quickdraft.models.eagle3 import rms_norm, rotate
from quickdraft.train.loop import fit, head_rows

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _dense(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.detach().float().clone())


def _linear(weights: dict, name: str, bias: bool) -> torch.nn.Linear:
    """An ``nn.Linear`` holding ``name``'s weights: peft's LoRA wraps ``nn.Linear`` modules by name."""
    w = weights[name + ".weight"]
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias, device="meta")  # no throwaway init
    lin.weight = _dense(w)
    if bias:
        lin.bias = _dense(weights[name + ".bias"])
    return lin


class _Norm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = _dense(weight)


class _Layer(torch.nn.Module):
    """One decoder layer's weights, laid out as Hugging Face's modules (so its state-dict keys are
    the weight names, and ``q_proj`` ... ``down_proj`` are LoRA's target names)."""

    def __init__(self, weights: dict, p: str, attention_bias: bool):
        super().__init__()
        self.input_layernorm = _Norm(weights[p + "input_layernorm.weight"])
        self.post_attention_layernorm = _Norm(weights[p + "post_attention_layernorm.weight"])
        self.self_attn = torch.nn.Module()
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.self_attn, n, _linear(weights, p + "self_attn." + n, attention_bias and n != "o_proj"))
        self.mlp = torch.nn.Module()
        for n in ("gate_proj", "up_proj", "down_proj"):
            setattr(self.mlp, n, _linear(weights, p + "mlp." + n, False))


def spread_layers(num_layers: int, keep: int) -> list[int]:
    """``keep`` of ``num_layers`` layers, evenly spaced, the first and the last among them (the
    first reads the embedding, the last writes what the head reads)."""
    if not 1 <= keep <= num_layers:
        raise ConfigError(f"--draft-layers must be between 1 and the draft's {num_layers} layers, got {keep}",
                          "draft_layers")
    if keep == 1:
        return [num_layers - 1]
    return sorted({round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)})


def check_trainable(c) -> None:
    """TrainableDraft's forward is a Llama / Qwen2 layer with plain rotary embeddings and full
    attention: another model is refused before anything is trained."""
    if c.arch not in ("llama", "qwen2") or c.rope_scaling is not None or c.rotary_dim is not None or c.sliding_window:
        raise ConfigError(f"{c.name}: a draft is distilled from a Llama or Qwen2 model with plain rotary embeddings "
                          f"and full attention; this is a {c.arch} model"
                          f"{' with scaled rotary embeddings' if c.rope_scaling is not None else ''}", "draft_model")


class TrainableDraft(torch.nn.Module):
    """A llama / qwen2 model's weights as float32 parameters, with a forward; its state-dict keys
    are the Hugging Face weight names."""

    def __init__(self, model, keep_layers: list[int] | None = None):
        super().__init__()
        c = model.config
        check_trainable(c)
        keep = list(range(c.num_layers)) if keep_layers is None else list(keep_layers)
        if not keep or sorted(set(keep)) != keep or keep[0] < 0 or keep[-1] >= c.num_layers:
            raise ConfigError(f"the layers to keep must be increasing indices in 0..{c.num_layers - 1} of "
                              f"{c.name or 'the draft'}'s {c.num_layers}, got {keep_layers}", "draft_layers")
        c = self.config = dataclasses.replace(c, num_layers=len(keep))
        w = model.weights
        self.model = torch.nn.Module()
        embed = w["model.embed_tokens.weight"]
        self.model.embed_tokens = torch.nn.Embedding(embed.shape[0], embed.shape[1], device="meta")
        self.model.embed_tokens.weight = _dense(embed)
        self.model.layers = torch.nn.ModuleList(_Layer(w, f"model.layers.{i}.", c.attention_bias) for i in keep)
        self.model.norm = _Norm(w["model.norm.weight"])
        if not c.tie_word_embeddings:
            self.lm_head = _linear(w, "lm_head", False)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> the final norm's output [B, T, H] (a causal pass from position 0)."""
        c = self.config
        B, T = tokens.shape
        x = self.model.embed_tokens(tokens)
        pos = torch.arange(T).expand(B, T)
        group = c.num_heads // c.num_kv_heads
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            h = rms_norm(x, layer.input_layernorm.weight, c.rms_norm_eps)
            q = rotate(a.q_proj(h).view(B, T, c.num_heads, c.head_dim), pos, c.rope_theta).transpose(1, 2)
            k = rotate(a.k_proj(h).view(B, T, c.num_kv_heads, c.head_dim), pos, c.rope_theta).transpose(1, 2)
            v = a.v_proj(h).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                  is_causal=True)
            x = x + a.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
            h = rms_norm(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
            x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
        return rms_norm(x, self.model.norm.weight, c.rms_norm_eps)

    def head_weight(self) -> torch.Tensor:
        """The output head's [V, H] matrix (the embedding's when tied)."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] float32 (a causal pass from position 0)."""
        return F.linear(self.hidden(tokens), self.head_weight()).float()


# Positions whose full-vocabulary logits are held at once by the distillation loss. The whole
# window's are [B, T, V] float32 several times over (log-softmaxes of p and q, their difference,
# and what autograd keeps): 0.6 GB each for 2 x 512 positions x 151936 tokens of the Qwen pair. A
# chunk's logits are recomputed in the backward pass instead of kept. Measured side by side on the
# Qwen pair (3 steps, the same data, twice each; AMD EPYC): peak RSS 11.1 GiB against 12.7 GiB for
# one chunk of the whole window; the rest is the two models and the labelled data.
KL_CHUNK = 256


def _kl_chunk(h: torch.Tensor, final: torch.Tensor, head: torch.Tensor, target_head: torch.Tensor):
    """Summed KL(p_target || q_draft) over a chunk of positions, and how many argmaxes agree."""
    with torch.no_grad():
        logp = torch.log_softmax((final @ target_head.T).float(), dim=-1)
    logq = torch.log_softmax(F.linear(h, head).float(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum()
    return kl, (logq.detach().argmax(-1) == logp.argmax(-1)).sum()


def kl_loss(draft: TrainableDraft, target_head: torch.Tensor, batch, chunk: int = KL_CHUNK):
    """Mean KL(p_target || q_draft) over the valid positions -> (loss, {agree}), computed ``chunk``
    positions at a time under activation checkpointing (KL_CHUNK): the same loss and gradients as
    one pass over the window, with the memory of one chunk's logits."""
    from torch.utils.checkpoint import checkpoint

    _, final, tokens, lengths = batch
    valid = torch.arange(tokens.shape[1]).view(1, -1) < lengths.view(-1, 1)
    h, f, head = draft.hidden(tokens)[valid], final[valid], draft.head_weight()  # [N, H], [N, H]
    total, agree = 0.0, 0
    for i in range(0, len(h), chunk):
        kl, hits = checkpoint(_kl_chunk, h[i:i + chunk], f[i:i + chunk], head, target_head, use_reentrant=False)
        total, agree = total + kl, agree + int(hits)
    n = int(valid.sum())
    return total / n, {"agree": agree / n}


def add_lora(module: TrainableDraft, rank: int, alpha: float, targets=LORA_TARGETS):
    """Wrap ``targets`` (the ``nn.Linear`` names) in LoRA adapters through ``peft``: every other weight
    is frozen, so only the adapters (2 x rank x (in + out) a matrix) get gradients and AdamW state.
    Returns the ``PeftModel``; ``module`` is changed in place."""
    if "lm_head" in targets:  # kl_loss multiplies by the head's matrix itself, past any adapter
        raise QuickdraftError("LoRA adapts the decoder layers' matrices, not lm_head: leave it out of --lora-targets")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise QuickdraftError("LoRA needs the peft package: pip install 'quickdraft[train]'") from e

    return get_peft_model(module, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0))


def train(target, draft, windows, out_dir: str | Path, steps: int = 500, batch_size: int = 2, lr: float = 2e-5,
          seed: int = 0, progress: bool = True, mixed: bool = True, lora_rank: int = 0, lora_alpha: float | None = None,
          lora_targets=LORA_TARGETS, keep_layers: list[int] | None = None) -> tuple[TrainableDraft, list[float]]:
    """Distill ``draft`` (a LoadedModel with dense weights) towards ``target`` on ``windows`` and
    save it as a model directory in ``out_dir``.

    ``lora_rank`` > 0 trains LoRA adapters (alpha default 2 x rank) on ``lora_targets`` instead of
    every weight, and merges them into the weights before saving: the saved draft has the stock
    draft's shape and runs through the engine's decoder at full speed, with no adapter math.
    ``keep_layers``: the draft's layers to keep (None: all), the rest dropped before training."""
    from quickdraft.proposers.draft.load import check_same_vocabulary

    check_same_vocabulary(target, draft)
    module = TrainableDraft(draft, keep_layers)
    tuning = {"method": "full"}
    checkpoint = Path(out_dir) / "checkpoint.pt"
    if lora_rank > 0:
        alpha = lora_alpha if lora_alpha is not None else 2.0 * lora_rank
        peft_model = add_lora(module, lora_rank, alpha, lora_targets)
        tuning = {"method": "lora", "rank": lora_rank, "alpha": alpha, "target_modules": list(lora_targets)}
        checkpoint = checkpoint.with_name(f"checkpoint-lora{lora_rank}.pt")  # its keys are not a full run's
    target_head = head_rows(target, torch.arange(target.config.vocab_size))
    losses = fit(module, lambda b: kl_loss(module, target_head, b), windows, steps, batch_size, lr,
                 checkpoint, "distilling the draft", seed, progress, save_every=100, mixed=mixed)
    if lora_rank > 0:
        module = peft_model.merge_and_unload()
    meta = {"distilled_from": draft.source, "target": target.source, "tuning": tuning}
    if keep_layers is not None:
        meta["kept_layers"] = list(keep_layers)  # the stock draft's indices of the saved layers 0, 1, ...
    save_dir(module, draft.tokenizer, out_dir, meta)
    return module, losses


def save_dir(module: TrainableDraft, tokenizer, out_dir: str | Path, meta: dict | None = None) -> Path:
    """A Hugging Face model directory quickdraft (and transformers) load; ``meta`` (how it was
    trained) goes under config.json's ``quickdraft`` key, which loaders ignore."""
    from safetensors.torch import save_file

    c = module.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().contiguous() for n, p in module.state_dict().items()}, str(out / "model.safetensors"))
    cfg = {"architectures": ["Qwen2ForCausalLM" if c.arch == "qwen2" else "LlamaForCausalLM"], "model_type": c.arch,
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
           "head_dim": c.head_dim, "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps,
           "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
           "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids),
           "hidden_act": "silu", "torch_dtype": "float32", "_name_or_path": f"{c.name or 'draft'}-distilled"}
    if c.arch == "llama":
        cfg["attention_bias"] = False  # Qwen2's config has no such key: its q/k/v biases are implied
    if meta is not None:
        cfg["quickdraft"] = meta
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer._tok.save(str(out / "tokenizer.json"))
        tok = lambda i: None if i is None else tokenizer.id_to_token(i)  # noqa: E731
        eos = list(tokenizer.eos_token_ids)
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": tok(tokenizer.bos_token_id), "eos_token": tok(eos[0]) if eos else None,
             "add_bos_token": tokenizer.add_bos_token, "chat_template": tokenizer.chat_template}, indent=2))
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out
