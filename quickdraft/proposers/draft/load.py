"""A draft model loaded and run for drafting, shared by the draft proposers (proposers/draft/model.py
and, for a draft with another tokenizer, proposers/draft/text.py): ``load_draft`` resolves a
speculative config's device, int8 or Q4_0 blocks and truncated output head (proposers/draft/vocab.py),
and ``draft_pass`` runs one pass over each slot's new tokens.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from quickdraft.errors import ConfigError
from quickdraft.models.kv_cache import KVCache
from quickdraft.models import registry
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.models.ggml import BlockWeight, on_blocks, requantize_wider, wider
from quickdraft.kernels import block_linear
from quickdraft.models.loader import cached_blocks, ids_key, select_rows
from quickdraft.models.memory import into_huge_pages
from quickdraft.models.quant import quantizable
from quickdraft.proposers.draft import vocab as draft_vocab

# Draft passes that read a long catch-up (a prompt) run at prefill speed per row, not at the
# speed the plan prices draft tokens at: the cost model learns from the others only.
MAX_OBSERVED_FEED = 8
# the block format "auto" gives a draft on GGUF blocks that are stored in more bits a weight than it
AUTO_DRAFT_BLOCKS = "Q4_0"


def load_draft(spec, ctx, check_vocabulary: bool):
    """The draft of a speculative config, ready for a Decoder: (loaded model, config, weights,
    quantization, head_ids), with the config's device, int8 and truncated-head options resolved.
    ``check_vocabulary``: refuse a draft whose vocabulary is not the target's."""
    device = available_device(spec.draft_device or ctx.device)
    requant = "Q4_0" if spec.quantization == "q4_0" else None
    if spec.quantization == "auto" and _loads_on_blocks(spec.model, ctx, device):
        requant = AUTO_DRAFT_BLOCKS  # as below, but the loader's own cached conversion: no stored copy read first
    if requant and (torch.device(device).type != "cpu" or block_linear() is None):
        raise ConfigError('quantization "q4_0" runs the draft on the CPU\'s GGUF block kernels, '
                          f"which the draft's device {device!r} does not have", "quantization")
    draft = ctx.load_model(spec.model, device=device, requantize=requant)
    if check_vocabulary:
        check_same_vocabulary(ctx.target, draft)
    quantize = spec.quantization
    stored = on_blocks(draft.weights)
    if quantize == "auto":  # a GGUF draft kept in its stored blocks is smaller than int8 already
        on_cpu = torch.device(device).type == "cpu"  # the int8 kernel is a CPU kernel
        quantize = "int8" if on_cpu and quantizable() and ctx.dtype == torch.bfloat16 and not stored else None
        if stored and on_cpu and block_linear() is not None:
            # and is requantized to Q4_0 where it is stored wider: a draft step reads fewer bytes
            # (the Qwen 0.5B: 224 against 296 MiB). Three bench runs of the Qwen pair
            # (docs/features/4bit-drafts.md): 1.25x, 1.21x, 1.23x over plain decoding against 1.11x, 1.20x, 1.06x as stored
            requant = AUTO_DRAFT_BLOCKS
    if quantize == "int8" and stored:
        raise ConfigError("the draft runs on its stored GGUF blocks, which are smaller than int8: leave the "
                          'draft\'s "quantization" out, or load the models dequantized (--quantization none)',
                          "quantization")
    head_ids = draft_vocab.resolve(spec, draft)
    config, weights = (draft.config, draft.weights) if head_ids is None else truncated_head(draft, head_ids)
    if requant:
        weights, quantize = requantized(draft, weights, requant, "full" if head_ids is None else ids_key(head_ids)), None
    return draft, config, weights, quantize, head_ids


def _loads_on_blocks(model, ctx, device: str) -> bool:
    """Whether ``ctx.load_model`` will put the draft ``model``, a name or path, on the CPU's GGUF
    block kernels: a GGUF file (every built-in is one), loaded as the target was, on blocks."""
    if not isinstance(model, str) or torch.device(device).type != "cpu" or block_linear() is None:
        return False
    return on_blocks(ctx.target.weights) and (registry.is_builtin(model) or model.endswith(".gguf"))


def draft_pass(model: Decoder, kv: KVCache, slots: list[int], cached: list[int], feeds: list[list[int]]) -> torch.Tensor:
    """One draft pass: each slot's ``feeds`` tokens [len_i] at positions ``cached[i]``.. written
    into ``kv``; logits [len(slots), N] of each feed's last row."""
    lens = [len(f) for f in feeds]
    if not all(lens):  # an empty feed has no last row: its logits would be another sequence's
        raise ValueError(f"draft_pass: every sequence feeds at least one token, got lengths {lens}")
    meta = AttentionMetadata.chain(slots, cached, lens)
    tokens = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=model.device)
    hidden = model.forward(tokens, meta.positions(model.device), kv, meta)
    if len(tokens) == len(feeds):  # one token each: every row is a last row
        return model.logits(hidden)
    last = list(itertools.accumulate(lens))
    return model.logits(hidden[torch.tensor(last, device=hidden.device) - 1])


def available_device(name: str) -> str:
    """``name`` if this machine has that device, else a ConfigError that says what it has."""
    dev = torch.device(name)
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f'draft_device "{name}": this machine has no CUDA device (torch {torch.__version__})',
                              "draft_device")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f'draft_device "{name}": this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}',
                              "draft_device")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f'draft_device "{name}": MPS is not available here', "draft_device")
    elif dev.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise ConfigError(f'draft_device "{name}": no XPU device here', "draft_device")
    return name


def truncated_head(draft, ids: torch.Tensor):
    """(config, weights) of ``draft`` with an output head of only the rows ``ids`` [N]: a dense
    ``w[ids]`` or a GGUF ``BlockWeight.select(ids)``, chosen once at load. The embedding keeps
    every row (any token can be read), so a tied head becomes an untied one; int8 quantization,
    one scale per row, then quantizes the N rows alone, as selecting rows of the quantized head would."""
    w = dict(draft.weights)
    name = "model.embed_tokens.weight" if draft.config.tie_word_embeddings else "lm_head.weight"
    # a GGUF head's rows repacked once and kept in the cache (loader.select_rows), a dense one's indexed
    head = select_rows(draft, name, ids) if isinstance(w[name], BlockWeight) else w[name][ids].contiguous()
    w["lm_head.weight"] = into_huge_pages({"head": head})["head"]  # a new tensor: see models/memory.py
    return dataclasses.replace(draft.config, tie_word_embeddings=False), w


def requantized(draft, weights: dict, kind: str, head: str) -> dict:
    """``weights`` of a draft handed in already loaded, with every matrix wider than ``kind``
    requantized (``ggml.requantize_wider``; a draft loaded here by name comes requantized from
    the loader instead), made once and kept beside its conversion; ``head`` names the output
    head's rows."""
    names = [n for n, w in weights.items() if wider(w, kind)]
    if not names:
        return weights
    made = cached_blocks(draft, f"{kind.lower()}-{head}", lambda: requantize_wider({n: weights[n] for n in names}, kind))
    device = next(iter(weights.values())).device
    # the weights kept as they were are copied out of the loaded file's arena (fresh), which is
    # then freed instead of held by their views
    kept = into_huge_pages({n: w for n, w in weights.items() if n not in made}, fresh=True)
    return {**kept, **{n: w.to(device) for n, w in made.items()}}


def head_rows(head, ids: torch.Tensor):
    """The rows ``ids`` [N] of an output head: a dense ``w[ids]`` or a GGUF ``BlockWeight.select(ids)``."""
    head = head.select(ids) if isinstance(head, BlockWeight) else head[ids].contiguous()
    return into_huge_pages({"head": head})["head"]  # a new tensor: see models/memory.py


def check_same_vocabulary(target, draft) -> None:
    """A draft must speak the target's token ids, or its proposals mean nothing. Its family may
    differ (a Qwen2.5 draft for a Qwen3 target shares its tokenizer): the output stays the
    target's either way, and only the ids decide whether drafting can work at all."""
    t, d = target.tokenizer, draft.tokenizer
    same = t.same_vocabulary(d) if t is not None and d is not None else t is d
    if target.config.vocab_size != draft.config.vocab_size or not same:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.config.arch}, {draft.config.vocab_size} tokens, {draft.source}) differs "
            f"from the target's ({target.config.arch}, {target.config.vocab_size} tokens, {target.source}); a draft must share the "
            "target's tokenizer, or propose through text: add \"cross_tokenizer\": true to the speculative config "
            "(universal assisted generation: drafts re-encoded with the target's tokenizer)", "model",
        )
