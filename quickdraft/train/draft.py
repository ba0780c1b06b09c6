"""Distilling the draft model towards the target (``quickdraft train draft``).

The published recipe for a separate draft (DistillSpec, Zhou et al. 2024) is to fine-tune it on
the target's own distribution: here a full fine-tune of every draft weight, minimising
KL(p_target || q_draft) at every position of the windows ``quickdraft train data`` labelled (the
target's p recomputed from the stored final hidden state over the whole vocabulary). The result is
a Hugging Face directory (``config.json``, ``model.safetensors``, the tokenizer files) that
``--speculative-config '{"method": "draft_model", "model": DIR}'`` loads like any draft.

The training forward is a plain autograd one (torch ops, causal scaled-dot-product attention);
the engine's decoder, which serves the result, is inference-only. tests/train/test_draft.py
checks that the two agree on the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft.models.eagle3 import rms_norm, rotate
from quickdraft.train.loop import fit, head_rows


class TrainableDraft(torch.nn.Module):
    """A llama / qwen2 model's weights (Hugging Face names) as parameters, with a forward."""

    def __init__(self, model):
        super().__init__()
        self.config = model.config
        self.names = [n for n in model.config.weight_names()]
        self.params = torch.nn.ParameterList(torch.nn.Parameter(model.weights[n].detach().float().clone())
                                             for n in self.names)

    def w(self, name: str) -> torch.Tensor:
        return self.params[self.names.index(name)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] float32 (a causal pass from position 0)."""
        c = self.config
        B, T = tokens.shape
        x = self.w("model.embed_tokens.weight")[tokens]
        pos = torch.arange(T).expand(B, T)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, self.w(p + "input_layernorm.weight"), c.rms_norm_eps)
            proj = lambda n, h=h, p=p: F.linear(h, self.w(p + f"self_attn.{n}.weight"),  # noqa: E731
                                                self.w(p + f"self_attn.{n}.bias") if c.attention_bias else None)
            q = rotate(proj("q_proj").view(B, T, c.num_heads, c.head_dim), pos, c.rope_theta).transpose(1, 2)
            k = rotate(proj("k_proj").view(B, T, c.num_kv_heads, c.head_dim), pos, c.rope_theta).transpose(1, 2)
            v = proj("v_proj").view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
            group = c.num_heads // c.num_kv_heads
            attn = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                  is_causal=True)
            x = x + F.linear(attn.transpose(1, 2).reshape(B, T, -1), self.w(p + "self_attn.o_proj.weight"))
            h = rms_norm(x, self.w(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            x = x + F.linear(F.silu(F.linear(h, self.w(p + "mlp.gate_proj.weight"))) * F.linear(h, self.w(p + "mlp.up_proj.weight")),
                             self.w(p + "mlp.down_proj.weight"))
        x = rms_norm(x, self.w("model.norm.weight"), c.rms_norm_eps)
        head = self.w("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight")
        return F.linear(x, head).float()


def kl_loss(draft: TrainableDraft, target_head: torch.Tensor, batch):
    """Mean KL(p_target || q_draft) over the valid positions -> (loss, {agree})."""
    _, final, tokens, lengths = batch
    T = tokens.shape[1]
    with torch.no_grad():
        logp = torch.log_softmax(final @ target_head.T, dim=-1)  # [B, T, V]
    logq = torch.log_softmax(draft(tokens), dim=-1)
    valid = torch.arange(T).view(1, -1) < lengths.view(-1, 1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    with torch.no_grad():
        agree = ((logq.argmax(-1) == logp.argmax(-1)) & valid).sum() / valid.sum()
    return (kl * valid).sum() / valid.sum(), {"agree": float(agree)}


def train(target, draft, windows, out_dir: str | Path, steps: int = 500, batch_size: int = 2, lr: float = 2e-5,
          seed: int = 0, progress: bool = True, mixed: bool = True) -> tuple[TrainableDraft, list[float]]:
    """Distill ``draft`` (a LoadedModel with dense weights) towards ``target`` on ``windows`` and
    save it as a model directory in ``out_dir``."""
    from quickdraft.proposers.draft_model import check_same_vocabulary

    check_same_vocabulary(target, draft)
    module = TrainableDraft(draft)
    target_head = head_rows(target, torch.arange(target.config.vocab_size))
    losses = fit(module, lambda b: kl_loss(module, target_head, b), windows, steps, batch_size, lr,
                 Path(out_dir) / "checkpoint.pt", "distilling the draft", seed, progress, save_every=100,
                 mixed=mixed)
    save_dir(module, draft.tokenizer, out_dir)
    return module, losses


def save_dir(module: TrainableDraft, tokenizer, out_dir: str | Path) -> Path:
    """A Hugging Face model directory quickdraft (and transformers) load."""
    from safetensors.torch import save_file

    c = module.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().contiguous() for n, p in zip(module.names, module.params)}, str(out / "model.safetensors"))
    cfg = {"architectures": ["Qwen2ForCausalLM" if c.arch == "qwen2" else "LlamaForCausalLM"], "model_type": c.arch,
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
           "head_dim": c.head_dim, "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps,
           "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
           "attention_bias": c.attention_bias, "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids),
           "hidden_act": "silu", "torch_dtype": "float32", "_name_or_path": f"{c.name or 'draft'}-distilled"}
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
