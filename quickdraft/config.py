"""Engine and speculative-decoding configuration: frozen dataclasses.

``SpeculativeConfig.parse`` reads the JSON of vLLM's ``--speculative-config`` flag (the same keys
where they exist) and names the valid keys when it meets an unknown one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields

from quickdraft.errors import ConfigError

METHODS = ("none", "ngram", "draft_model", "suffix", "eagle3", "medusa", "layer_skip")
TREE_METHODS = ("ngram", "suffix", "draft_model", "medusa", "eagle3")  # those that draft token trees (num_branches > 1)
# Measured (docs/features/truncated-vocabulary.md): on code, the Qwen pair's acceptance is the full
# head's at 65536 and 32768 and drops at 16384; 65536 also holds 98% of the tokens of English docs
# (32768: 90%), so it is the default that is safe for chat too. Qwen's head: 151936 -> 65536 rows.
DEFAULT_DRAFT_VOCAB_SIZE: int | None = 65536
MIN_DRAFT_VOCAB_SIZE = 256
DRAFT_QUANTIZATIONS = (None, "int8", "q4_0", "auto")
DEVICE_PATTERN = re.compile(r"(cpu|cuda|xpu|mps)(:\d+)?")  # torch's device names that can hold a model


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "none"
    # draft_model: the draft model, a built-in name or a path; eagle3, medusa: the head's directory
    # (speculators / vLLM Medusa layout), default the one `quickdraft train` writes for the target
    model: str | None = None
    num_speculative_tokens: int = 4  # K: draft tokens proposed per sequence per step
    prompt_lookup_max: int = 4  # ngram: longest n-gram matched
    prompt_lookup_min: int = 2  # ngram: shortest n-gram matched (1 proposes on any repeated token)
    # ngram, suffix, draft_model: token trees, verified in one pass (verify/tree.py). ngram merges
    # up to this many distinct continuations of earlier matches; suffix gives each node up to this
    # many children, best-first by path probability (both at most num_speculative_tokens nodes);
    # draft_model, eagle3 and medusa grow greedy requests' trees EAGLE-2's way, this many nodes expanded a
    # level and this many children each, num_speculative_tokens deep, the best num_speculative_tokens
    # x this many nodes kept, and with adaptive on, only those whose rows pay (engine/plan.py). 1: chains
    num_branches: int = 1
    # draft_model, layer_skip, eagle3: stop drafting for a sequence once the draft's own probability of its token
    # falls below this (a dynamic draft length, like HF's assistant_confidence_threshold). The
    # output is unchanged, it only saves draft passes whose tokens would likely be rejected. 0: off.
    # Measured here (4 HumanEval prompts, Qwen2.5-Coder 1.5B with the 0.5B, K = 8, one run):
    # speedup 1.39x off, 1.32x at 0.3, 1.60x at 0.5. On the GGUF pair (the q4_0 0.5B, K = 4 adaptive, 4
    # HumanEval + 4 MT-Bench, one run): 1.21x off, 1.15x at 0.3, 1.24x at 0.5, 1.23x at 0.7.
    draft_confidence_threshold: float = 0.5
    # layer_skip: the layers (whole: attention and MLP) the target skips to draft for itself,
    # fixed. None: the skip set is searched on the fly (proposers/draft/layer_skip.py)
    skip_layers: tuple[int, ...] | None = None
    # draft_model: "int8" runs the draft with int8 weights and activations (models/quant.py), half
    # the bytes a draft step reads; the output stays exactly the target's. None: the engine dtype.
    # "auto": a GGUF draft on the CPU's block kernels as "q4_0" below (its stored blocks where
    # they are 4.5 bits a weight or fewer); a dense draft in int8 where the int8 CPU kernel runs
    # and the engine is bfloat16. Measured here (6
    # HumanEval prompts, Qwen pair, K = 8): 1.49x bfloat16 draft -> 1.79x int8, 5.68 -> 5.58 tokens/pass.
    # "q4_0": every matrix of the draft stored in more than 4.5 bits a weight (a GGUF draft's Q5_0,
    # Q6_K, Q8_0, or a dense draft's) quantized again to GGUF Q4_0 blocks, once, and cached: fewer
    # bytes a draft step reads, on the CPU's block kernels (docs/features/4bit-drafts.md).
    # eagle3, medusa: the head's matrices are served from GGUF blocks (proposers/heads/common.py): "auto"
    # and "int8" Q8_0 where the CPU's block kernels run (auto: else float32, as trained), "q4_0"
    # Q4_0; None: float32.
    quantization: str | None = "auto"
    # draft_model: the device the draft runs on: "cpu", "cuda", "cuda:1", ... None: the target's
    # (--device). A draft on the CPU beside a target on a GPU leaves the GPU's memory to the
    # target's KV cache; its q and tokens reach the target's device once a step (engine/runner.py).
    draft_device: str | None = None
    # draft_model, layer_skip: the draft's output head scores only this many tokens, the most frequent in a
    # local corpus (the standard library's sources, never a benchmark's prompts; counted once per
    # machine and tokenizer, proposers/draft/vocab.py). Its q is zero elsewhere, which the
    # verifier's rule makes exact: only the speed changes. None: the whole vocabulary; a size at
    # least the vocabulary's (SmolLM2's 49152 at the default) is no truncation.
    draft_vocab_size: int | None = DEFAULT_DRAFT_VOCAB_SIZE
    # draft_model, layer_skip: a file of token ids (a JSON list, or one id a line) to use as the draft's
    # vocabulary instead of the counted one; special and end-of-text tokens are always added.
    draft_vocab_file: str | None = None
    # draft_model: the draft may have another tokenizer (transformers' "universal assisted
    # generation"): it reads its own tokenization of the target's text, and its greedy tokens are
    # decoded to text and re-encoded with the target's tokenizer (proposers/draft/text.py). They
    # are verified as point masses, so the output stays exactly the target's; a draft with the
    # target's vocabulary is accepted too (it then drafts through text as well). False: the draft
    # must share the target's vocabulary, which it is refused without.
    cross_tokenizer: bool = False
    # suffix (proposers/lookup/suffix.py; the first four are vLLM's keys, with its defaults): the suffix
    # tries hold every window of this many tokens; a match is at most depth - K tokens long
    suffix_decoding_max_tree_depth: int = 24
    # suffix: a match of m tokens drafts at most max_spec_factor * m tokens (and at most K)
    suffix_decoding_max_spec_factor: float = 1.0
    # suffix: a draft stops where its path's empirical probability (the product, token by token,
    # of how often that token followed the path before it) falls below this
    suffix_decoding_min_token_prob: float = 0.1
    # suffix: past requests' outputs kept in the global trie (the oldest leave first); 0: none
    suffix_decoding_max_cached_requests: int = 10000
    # suffix: and at most this many of their tokens. Memory: about 55 bytes a token and a level of
    # depth at worst (text that never repeats): 130 MB at the defaults; repeated text shares nodes.
    suffix_decoding_max_cached_tokens: int = 100_000
    # suffix: a file the global cache is loaded from at start and saved to (atomically) at
    # shutdown and every minute while requests finish, so that a restarted server keeps what it
    # learned. None: kept in memory only.
    suffix_decoding_cache_path: str | None = None
    # Choose each sequence's K every step, up to num_speculative_tokens, to maximize expected
    # tokens per second from a cost model the engine calibrates at start-up and refits as it runs
    # (engine/plan.py): a sequence whose drafts keep failing decodes plainly, and a batch large
    # enough that verification rows are dear drafts less or not at all. False: always K.
    adaptive: bool = True
    # adaptive: a sequence left without drafts this many steps is planned again as if its
    # drafts were good (an acceptance rate of at least 0.8), for one draft token, to see whether
    # its text has become predictable again.
    probe_interval: int = 8
    # Speculation turns off for a step whose running batch has at least this many sequences:
    # verification stops being nearly free once the batch fills the matrix units (vLLM's
    # speculative disable_by_batch_size). None: never.
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"unknown speculative method {self.method!r}; valid: {', '.join(METHODS)}", "method")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ConfigError(f"num_speculative_tokens must be an integer in 1..16, got {k!r}", "num_speculative_tokens")
        if self.method == "draft_model" and not self.model:
            raise ConfigError('method "draft_model" needs "model": the draft model name or path', "model")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ConfigError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}", "prompt_lookup_min"
            )
        nb = self.num_branches
        if isinstance(nb, bool) or not isinstance(nb, int) or not 1 <= nb <= 8:
            raise ConfigError(f"num_branches must be an integer in 1..8, got {nb!r}", "num_branches")
        if nb > 1 and (self.method not in TREE_METHODS or self.cross_tokenizer):
            raise ConfigError(f"num_branches > 1 (token trees) is for methods {', '.join(TREE_METHODS)} (a draft "
                              f"model of the target's tokenizer) so far, not {self.method!r}"
                              + (" with cross_tokenizer" if self.cross_tokenizer else ""), "num_branches")
        t = self.draft_confidence_threshold
        if not isinstance(t, (int, float)) or not 0.0 <= t < 1.0:
            raise ConfigError(f"draft_confidence_threshold must be in [0, 1), got {t!r}", "draft_confidence_threshold")
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise ConfigError(f'quantization must be null, "int8", "q4_0" or "auto", got {self.quantization!r}', "quantization")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"adaptive must be true or false, got {self.adaptive!r}", "adaptive")
        if not isinstance(self.probe_interval, int) or self.probe_interval < 1:
            raise ConfigError(f"probe_interval must be an integer >= 1, got {self.probe_interval!r}", "probe_interval")
        n = self.draft_vocab_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < MIN_DRAFT_VOCAB_SIZE):
            raise ConfigError(f"draft_vocab_size must be null (the whole vocabulary) or an integer >= "
                              f"{MIN_DRAFT_VOCAB_SIZE}, got {n!r}", "draft_vocab_size")
        f = self.draft_vocab_file
        if f is not None and (not isinstance(f, str) or not f):
            raise ConfigError(f"draft_vocab_file must be a path to a file of token ids, got {f!r}", "draft_vocab_file")
        self._check_suffix()
        if not isinstance(self.cross_tokenizer, bool):
            raise ConfigError(f"cross_tokenizer must be true or false, got {self.cross_tokenizer!r}", "cross_tokenizer")
        if self.cross_tokenizer and self.method != "draft_model":
            raise ConfigError(f'cross_tokenizer is for method "draft_model" (a draft model with another tokenizer), '
                              f"not {self.method!r}", "cross_tokenizer")
        sl = self.skip_layers
        if sl is not None:
            if not isinstance(sl, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in sl):
                raise ConfigError(f"skip_layers must be a list of layer indices, got {sl!r}", "skip_layers")
            if self.method != "layer_skip":
                raise ConfigError(f'skip_layers is for method "layer_skip", not {self.method!r}', "skip_layers")
            object.__setattr__(self, "skip_layers", tuple(sl))
        d = self.draft_device
        if d is not None:
            if not isinstance(d, str) or not DEVICE_PATTERN.fullmatch(d):
                raise ConfigError(f'draft_device must be a device such as "cpu", "cuda" or "cuda:1", got {d!r}',
                                  "draft_device")
            if self.method != "draft_model":
                raise ConfigError(f'draft_device places a draft model: it is for method "draft_model", not '
                                  f"{self.method!r}", "draft_device")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or b < 1):
            raise ConfigError(f"disable_by_batch_size must be an integer >= 1, got {b!r}", "disable_by_batch_size")

    def _check_suffix(self) -> None:
        d = self.suffix_decoding_max_tree_depth
        if isinstance(d, bool) or not isinstance(d, int) or not 2 <= d <= 1024:
            raise ConfigError(f"suffix_decoding_max_tree_depth must be an integer in 2..1024, got {d!r}",
                              "suffix_decoding_max_tree_depth")
        if self.method == "suffix" and d <= self.num_speculative_tokens:
            raise ConfigError(f"suffix_decoding_max_tree_depth ({d}) must exceed num_speculative_tokens "
                              f"({self.num_speculative_tokens}): a draft of K tokens continues a match of at least "
                              "one token inside one window of the trie", "suffix_decoding_max_tree_depth")
        f = self.suffix_decoding_max_spec_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
            raise ConfigError(f"suffix_decoding_max_spec_factor must be a number > 0 (draft tokens per matched "
                              f"token), got {f!r}", "suffix_decoding_max_spec_factor")
        p = self.suffix_decoding_min_token_prob
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ConfigError(f"suffix_decoding_min_token_prob must be a probability in [0, 1], got {p!r}",
                              "suffix_decoding_min_token_prob")
        for key in ("suffix_decoding_max_cached_requests", "suffix_decoding_max_cached_tokens"):
            n = getattr(self, key)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ConfigError(f"{key} must be an integer >= 0 (0: no global cache), got {n!r}", key)
        c = self.suffix_decoding_cache_path
        if c is not None and (not isinstance(c, str) or not c):
            raise ConfigError(f"suffix_decoding_cache_path must be a file path or null, got {c!r}",
                              "suffix_decoding_cache_path")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig":
        """From a JSON string, a dict, an instance or None (= method "none")."""
        if value is None:
            return cls()
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"the speculative config must be a JSON object, got {type(value).__name__}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(valid))
        if unknown:
            raise ConfigError(f"unknown speculative config key(s) {unknown}; valid keys: {', '.join(valid)}")
        return cls(**value)

    @property
    def enabled(self) -> bool:
        return self.method != "none"


DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's context length, capped at 4096
    max_num_seqs: int = 8  # sequences decoding at once (KV-cache slots)
    max_queue: int = 64  # requests waiting for a slot before new ones are refused
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # "gguf": a GGUF's block-quantized matrices (Q4_K, Q6_K, Q8_0, ...) stay as stored, target and
    # draft, multiplied by the CPU kernels of kernels/blocks.cpp; "none" (or None):
    # dequantized to dtype; "auto": "gguf" where those kernels run (models/loader.py)
    quantization: str | None = "auto"
    # A new prompt (the next chat turn, a shared system prompt) starts from the longest prefix it
    # shares with the tokens a KV slot holds, the target's and the draft's (engine/prefix_cache.py).
    # Outputs are the same either way where the decoder is batch invariant (its ``batch_invariance``
    # says where: the CPU paths): a key computed in any pass equals the one a prompt pass computes.
    # Where it is not (cuBLAS), a reused key may differ from a recomputed one in rounding, as in vLLM.
    enable_prefix_caching: bool = True
    # On a CUDA device the regular decoding passes replay CUDA graphs (models/decoder/graphs.py);
    # True runs every pass eagerly (vLLM's flag).
    enforce_eager: bool = False

    def __post_init__(self):
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}",
                              "enable_prefix_caching")
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager must be true or false, got {self.enforce_eager!r}", "enforce_eager")
        if self.quantization not in (None, "none", "gguf", "auto"):
            raise ConfigError(f'quantization must be "auto", "gguf", "none" or null, got {self.quantization!r}', "quantization")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}", "dtype")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}", "max_num_seqs")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len!r}", "max_model_len")

    @property
    def torch_dtype(self):
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]
