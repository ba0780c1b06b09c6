"""The EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test") and its files.

The head drafts from the target's own states. For a position t it reads the *feature* g_t and the
embedding of the token after it, x_{t+1}, and predicts x_{t+2}:

- feature: at the first draft step, ``fc`` of the residual streams entering three target layers
  (the reference code and vLLM take layers 2, L/2 and L-3), concatenated [3H] -> [H]; at a later
  step, the head's own output (before its final norm) of the step before.
- one decoder layer whose attention reads [norm(embedding); norm(feature)] (2H) and whose residual
  is the feature (``hidden_norm``'s input, or its output with ``norm_before_residual``), then an
  MLP, then ``norm`` and ``lm_head`` over a *truncated draft vocabulary* of N target tokens:
  ``d2t[i]`` is the offset from draft row i to its target id (target = i + d2t[i]) and ``t2d`` the
  [V] mask of target ids the head can propose, as in the ``speculators`` and EAGLE-3 files.

Files: Red Hat's ``speculators`` format (what vLLM loads): ``config.json`` with
``speculators_model_type: "eagle3"``, ``transformer_layer_config``, ``draft_vocab_size``,
``eagle_aux_hidden_state_layer_ids`` and ``speculators_config`` (the verifier, i.e. the target),
and ``model.safetensors`` with ``fc.weight``, ``layers.0.*``, ``norm.weight``, ``lm_head.weight``,
``d2t``, ``t2d``. The EAGLE authors' layout (a plain Llama config with ``draft_vocab_size``,
architectures ``LlamaForCausalLMEagle3``, weights ``midlayer.*`` in ``pytorch_model.bin`` or
safetensors: EAGLE3-LLaMA3.1-Instruct-8B), which SpecForge and SGLang write too, is read as well;
where it does not name the target layers it reads, they are EAGLE's own choice (2, L/2, L-3) for
the target it is loaded against. The layer's config is read as a model's is (models/hf.py): its
rotary scaling (Llama 3.1's ``llama3``) in either transformers layout, and a key that changes the
arithmetic and is not understood is an error. quickdraft adds a ``quickdraft`` key with the target's
fingerprint, so that a head loaded against another target or vocabulary is a clear error.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.errors import ConfigError, ModelFormatError
from quickdraft.models import head_dir
from quickdraft.models.rope import Rope, RopeScaling, hf_rope_scaling, inverse_frequencies, rope_from_hf

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config keys these files follow (checked against its source)
_LAYER = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
          "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The states EAGLE-3 fuses: those entering layers 2, L/2 and L-3 (clamped for tiny models)."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


def target_key(model) -> str:
    """A target's fingerprint: its shape, its tokenizer and its final norm's weights (rounded to
    bfloat16, so that a float32 and a bfloat16 load of one model agree)."""
    c = model.config
    h = hashlib.sha256(json.dumps([c.arch, c.vocab_size, c.hidden_size, c.num_layers, c.num_heads,
                                   c.num_kv_heads, c.intermediate_size]).encode())
    if model.tokenizer is not None:
        h.update(model.tokenizer.fingerprint().encode())
    norm = model.weights["model.norm.weight"].detach().to("cpu", torch.bfloat16).float()
    h.update(norm.numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # N rows of lm_head
    aux_layers: tuple[int, ...]  # target layers whose entering states fc fuses
    target: str  # the target's name (speculators' verifier name_or_path)
    target_key: str | None = None  # target_key(target); None: a head made elsewhere
    norm_before_residual: bool = False
    rope_scaling: RopeScaling | None = None  # the layer's (models/rope.py), as its config says

    @classmethod
    def for_target(cls, model, draft_vocab_size: int, name: str | None = None) -> "Eagle3Config":
        c = model.config
        return cls(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                   c.rope_theta, c.max_position_embeddings, c.vocab_size, draft_vocab_size,
                   default_aux_layers(c.num_layers), name or c.name or str(model.source), target_key(model),
                   # the target's scaling where a config can say it; a GGUF's per-frequency factors
                   # have no transformers form, so such a head turns as plain RoPE (its file says so)
                   rope_scaling=c.rope_scaling if c.rope_scaling is None or c.rope_scaling.kind != "factors" else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, scaling: RopeScaling | None = None,
           max_positions: int = 0) -> torch.Tensor:
    """Rotary embedding, Hugging Face's rotate-half layout: x [..., n, heads, d], positions [..., n];
    ``scaling``: the frequencies and factor of models/rope.py for a table of ``max_positions``."""
    d = x.shape[-1]
    inv_freq, factor = _frequencies(float(theta), scaling, d, max_positions)
    angles = positions.float().unsqueeze(-1) * inv_freq.to(x.device)  # [..., n, d/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(-2)  # [..., n, 1, d]
    xf = x.float()
    rotated = torch.cat([-xf[..., d // 2 :], xf[..., : d // 2]], dim=-1)
    cos, sin = (angles.cos(), angles.sin()) if factor == 1.0 else (angles.cos() * factor, angles.sin() * factor)
    return (xf * cos + rotated * sin).to(x.dtype)


@functools.lru_cache(maxsize=16)
def _frequencies(theta: float, scaling: RopeScaling | None, d: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(float32 [d/2] inverse frequencies on the CPU, the factor on cos and sin): computed once per
    head shape, not at every draft step."""
    if scaling is None:
        return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)), 1.0
    inv, factor = inverse_frequencies(Rope(theta, scaling), d, max_positions)
    return inv.float(), factor


class Eagle3Head(nn.Module):
    """fc, one decoder layer over [embedding; feature], norm, lm_head over the draft vocabulary."""

    def __init__(self, config: Eagle3Config, draft_ids: torch.Tensor):
        """``draft_ids`` [N] int64 ascending: the target id of each lm_head row."""
        super().__init__()
        c = self.config = config
        H, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.fc = nn.Linear(len(c.aux_layers) * H, H, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(H))
        self.hidden_norm = nn.Parameter(torch.ones(H))
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.q_proj = nn.Linear(2 * H, q, bias=False)
        self.k_proj = nn.Linear(2 * H, kv, bias=False)
        self.v_proj = nn.Linear(2 * H, kv, bias=False)
        self.o_proj = nn.Linear(q, H, bias=False)
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)
        self.norm = nn.Parameter(torch.ones(H))
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        if draft_ids.numel() != c.draft_vocab_size:
            raise ValueError(f"{draft_ids.numel()} draft ids for a draft vocabulary of {c.draft_vocab_size}")
        self.register_buffer("draft_ids", draft_ids.long().clone(), persistent=False)

    # -- the layer, in two halves so that training and serving each bring their own attention -----
    def project(self, emb: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor):
        """emb, feature [..., n, H], positions [..., n] -> q [..., n, heads, d], k and v
        [..., n, kv_heads, d] (rotated), and the residual [..., n, H]."""
        c = self.config
        e = rms_norm(emb, self.input_layernorm, c.rms_norm_eps)
        h = rms_norm(feature, self.hidden_norm, c.rms_norm_eps)
        residual = h if c.norm_before_residual else feature
        x = torch.cat([e, h], dim=-1)
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(*shape, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(*shape, c.num_kv_heads, c.head_dim)
        turn = (c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        return rotate(q, positions, *turn), rotate(k, positions, *turn), v, residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [..., n, heads * d] -> the layer's output before the final norm [..., n, H] (the
        next draft step's feature)."""
        x = residual + self.o_proj(attn)
        h = rms_norm(x, self.post_attention_layernorm, self.config.rms_norm_eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """out [..., H] -> [..., N] over the draft vocabulary, float32."""
        return self.lm_head(rms_norm(out, self.norm, self.config.rms_norm_eps)).float()

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence at serving time: q [n, heads, d] at positions ctx..ctx+n-1 over keys and
        values [ctx + n, kv_heads, d] (causal among the n; or ``mask`` [n, L] over keys and
        values [L, kv_heads, d], True = may attend: a token tree's rows) -> [n, heads * d]."""
        c = self.config
        n, group = q.shape[0], c.num_heads // c.num_kv_heads
        k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, L, d]
        v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
        if mask is None:
            mask = torch.ones(n, ctx + n, dtype=torch.bool, device=q.device).tril(ctx)
        out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask)  # [heads, n, d]
        return out.transpose(0, 1).reshape(n, c.num_heads * c.head_dim).to(q.dtype)

    # -- files ---------------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """Tensors by their speculators names."""
        p = "layers.0."
        w = {"fc.weight": self.fc.weight, p + "input_layernorm.weight": self.input_layernorm,
             p + "hidden_norm.weight": self.hidden_norm, p + "post_attention_layernorm.weight": self.post_attention_layernorm,
             "norm.weight": self.norm, "lm_head.weight": self.lm_head.weight}
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w[f"{p}self_attn.{name}.weight"] = getattr(self, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            w[f"{p}mlp.{name}.weight"] = getattr(self, name).weight
        w = {k: v.detach().contiguous() for k, v in w.items()}
        ids = self.draft_ids.cpu()
        w["d2t"] = ids - torch.arange(ids.numel())
        w["t2d"] = torch.zeros(self.config.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        return w

    def load_state(self, w: dict[str, torch.Tensor]) -> None:
        own = self.state()
        missing = [n for n in own if n not in ("d2t", "t2d") and n not in w]
        if missing:
            raise ConfigError(f"the EAGLE-3 head's weights lack {missing[:3]}")
        with torch.no_grad():
            for name, t in own.items():
                if name in ("d2t", "t2d"):
                    continue
                if tuple(w[name].shape) != tuple(t.shape):
                    raise ConfigError(f"the EAGLE-3 head's {name} has shape {tuple(w[name].shape)}, its config says "
                                      f"{tuple(t.shape)}")
                self._param(name).copy_(w[name])

    def _param(self, name: str) -> torch.Tensor:
        short = name.removeprefix("layers.0.").removeprefix("self_attn.").removeprefix("mlp.")
        short = short.removesuffix(".weight")
        obj = getattr(self, short)
        return obj.weight if isinstance(obj, nn.Linear) else obj


def speculators_config(head: Eagle3Head, num_speculative_tokens: int = 3, extra: dict | None = None) -> dict:
    """config.json in the speculators format (Eagle3SpeculatorConfig's keys)."""
    c = head.config
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size,
             "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
             "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
             "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu",
             "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
             "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    if c.rope_scaling is not None:
        layer["rope_scaling"] = hf_rope_scaling(c.rope_scaling)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": c.target, "architectures": []},
        },
        "quickdraft": {"target_key": c.target_key, **(extra or {})},
    }


def save(head: Eagle3Head, path: str | Path, num_speculative_tokens: int = 3, extra: dict | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (speculators format) into ``path``, each
    atomically (a reader never sees half a file)."""
    return head_dir.save(path, head.state(), speculators_config(head, num_speculative_tokens, extra))


def load(path: str | Path, target_layers: int | None = None) -> Eagle3Head:
    """A head from a directory in the speculators format or EAGLE's own (``midlayer.*``);
    ``target_layers``: the target's layer count, for a file that does not name the layers it reads."""
    path = Path(path)
    doc, w = head_dir.load(path, "an EAGLE-3 head")
    w = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v for k, v in w.items()}
    # EAGLE's own files carry the target's embedding, which the head reads from the target itself
    w.pop("embed_tokens.weight", None)
    config = _config(doc, w, path, target_layers)
    if "d2t" in w:
        ids = w["d2t"].long() + torch.arange(w["d2t"].numel())
    else:  # a head over the whole vocabulary
        ids = torch.arange(config.vocab_size)
    head = Eagle3Head(config, ids)
    head.load_state(w)
    return head.eval()


# the keys of a speculators config.json beside its layer's (Eagle3SpeculatorConfig and its base)
_SPECULATORS_KEYS = frozenset((
    "architectures", "speculators_model_type", "speculators_version", "speculators_config", "transformer_layer_config",
    "draft_vocab_size", "norm_before_residual", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
    "embed_requires_grad", "transformers_version", "torch_dtype", "dtype", "quickdraft",
    "norm_before_fc", "fc_norm", "norm_output",  # refused below when set
))
# the layer's own keys beyond a Llama model's (EAGLE's and SpecForge's Llama-shaped config)
_LAYER_KEYS = ("draft_vocab_size", "eagle_config", "eagle_aux_hidden_state_layer_ids", "norm_before_residual",
               "target_hidden_size", "attention_bias", "mlp_bias")


def _check_keys(doc: dict, layer: dict, path: Path) -> None:
    """Every key of the head's config is one quickdraft reads or one that changes nothing (the rule
    of models/hf.py for a model's config)."""
    from quickdraft.models.hf import _COMMON, _INERT

    if layer is not doc:
        extra = sorted(k for k in doc if k not in _SPECULATORS_KEYS)
        if extra:
            raise ConfigError(f"{path}/config.json key(s) {', '.join(extra)} are not understood for an EAGLE-3 head")
    extra = sorted(k for k in layer if k not in _INERT and k not in _COMMON and k not in _LAYER_KEYS
                   and not (layer is doc and k in _SPECULATORS_KEYS))
    if extra:
        raise ConfigError(f"{path}/config.json: the head's layer key(s) {', '.join(extra)} are not understood")
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            raise ConfigError(f"{path}/config.json: {key} is set; EAGLE-3 heads have none")
    act = layer.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{path}/config.json: hidden_act {act!r}; an EAGLE-3 head's MLP is SiLU-gated")
    if layer.get("num_hidden_layers", 1) != 1:
        raise ConfigError(f"{path}/config.json: {layer['num_hidden_layers']} layers; an EAGLE-3 head has one")


def _config(doc: dict, w: dict, path: Path, target_layers: int | None = None) -> Eagle3Config:
    if doc.get("speculators_model_type", "eagle3") != "eagle3":
        raise ConfigError(f"{path} holds a {doc['speculators_model_type']!r} speculator, not an EAGLE-3 head")
    unsupported = [k for k in ("norm_before_fc", "fc_norm", "norm_output") if doc.get(k)]
    if unsupported:  # later speculators variants (gpt-oss style, EAGLE 3.1): another network
        raise ConfigError(f"the EAGLE-3 head at {path} sets {unsupported}, variants quickdraft does not run yet")
    speculators = "transformer_layer_config" in doc
    layer = doc["transformer_layer_config"] if speculators else doc  # EAGLE, SpecForge: the Llama config is the file
    _check_keys(doc, layer, path)
    ours = doc.get("quickdraft", {})
    verifier = doc.get("speculators_config", {}).get("verifier", {}).get("name_or_path") or ""
    H = layer["hidden_size"]
    heads = layer["num_attention_heads"]
    target_hidden = doc.get("target_hidden_size") or layer.get("target_hidden_size")
    if target_hidden not in (None, H):
        raise ConfigError(f"{path}/config.json: target_hidden_size {target_hidden} differs from the head's {H}; "
                          "quickdraft runs heads as wide as their target")
    head_dim = layer.get("head_dim") or H // heads
    try:
        rope = rope_from_hf(layer, head_dim, f"{path}/config.json")
    except ModelFormatError as e:
        raise ConfigError(str(e)) from None
    if rope.rotary_dim is not None:
        raise ConfigError(f"{path}/config.json: partial rotary embeddings are not supported in a head")
    aux = doc.get("eagle_aux_hidden_state_layer_ids") or (doc.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is None and target_layers is not None:
        aux = default_aux_layers(target_layers)  # what EAGLE's code and vLLM take for such a file
    if aux is None:
        raise ConfigError(f"{path}/config.json does not say which target layers the head reads "
                          "(eagle_aux_hidden_state_layer_ids)")
    n = doc.get("draft_vocab_size") or layer.get("draft_vocab_size") or w["lm_head.weight"].shape[0]
    # speculators' default is True (vLLM reads it so); EAGLE's own layout has no such norm
    before = doc.get("norm_before_residual", speculators)
    return Eagle3Config(H, layer["intermediate_size"], heads, layer.get("num_key_value_heads", heads),
                        head_dim, layer.get("rms_norm_eps", 1e-6), rope.theta,
                        layer.get("max_position_embeddings", 4096), layer["vocab_size"], int(n), tuple(aux), verifier,
                        ours.get("target_key"), bool(before), rope.scaling)


def check_target(config: Eagle3Config, model, source: str) -> None:
    """A head drafts for the target it was trained on: another target (or vocabulary) is an error."""
    bad = [i for i in config.aux_layers if not 0 <= i < model.config.num_layers]
    if bad:
        raise ConfigError(f"the EAGLE-3 head {source} reads target layers {list(config.aux_layers)}, but this target "
                          f"has {model.config.num_layers}", "model")
    check_head_target("the EAGLE-3 head", config, model, source)


def check_head_target(what: str, config, model, source: str) -> None:
    """``what`` ("the EAGLE-3 head", "the Medusa heads"), whose ``config`` declares vocab_size,
    hidden_size, target and target_key, was made for this ``model``, or a ConfigError says not."""
    c = model.config
    this = c.name or model.source
    if config.vocab_size != c.vocab_size or config.hidden_size != c.hidden_size:
        raise ConfigError(f"{what} {source} was made for {config.target!r} (vocabulary {config.vocab_size}, "
                          f"hidden size {config.hidden_size}), not for this target {this!r} "
                          f"(vocabulary {c.vocab_size}, hidden size {c.hidden_size})", "model")
    if config.target_key is not None and config.target_key != target_key(model):
        raise ConfigError(f"{what} {source} was trained on {config.target!r}, another model than this target "
                          f"{this!r} (their fingerprints differ): train one for this target", "model")
    if config.target_key is None and config.target and not _same_name(config.target, c.name or str(model.source)):
        raise ConfigError(f"{what} {source} declares its target {config.target!r}, not this target {this!r}", "model")


def _same_name(a: str, b: str) -> bool:
    """Hub names and ours: 'Qwen/Qwen2.5-Coder-1.5B-Instruct' names 'qwen2.5-coder-1.5b-instruct'."""
    norm = lambda s: Path(s).name.lower().removesuffix(".gguf")  # noqa: E731
    return norm(a) == norm(b) or norm(a) in norm(b) or norm(b) in norm(a)


def init_from_target(head: Eagle3Head, model) -> None:
    """Start lm_head from the target's rows for the draft vocabulary, and norm from its final norm:
    the head then begins near the target's own prediction from the feature."""
    w = model.weights
    lm = w["model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"]
    if not isinstance(lm, torch.Tensor):
        lm = lm.dequantize(torch.float32)
    with torch.no_grad():
        head.lm_head.weight.copy_(lm[head.draft_ids.to(lm.device)].float())
        head.norm.copy_(w["model.norm.weight"].float())
        n, H = len(head.config.aux_layers), head.config.hidden_size
        # fc starts as the mean of the fused states: a sensible feature from the first step on
        head.fc.weight.copy_(torch.cat([torch.eye(H) / n] * n, dim=1))
        # and the layer starts as the identity on that feature (its two output projections zero,
        # as in ReZero): a random layer would add noise that the first hundred steps unlearn
        head.o_proj.weight.zero_()
        head.down_proj.weight.zero_()

