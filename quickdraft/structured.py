"""Structured outputs: a grammar that every emitted token follows, under speculation too.

A request's ``StructuredSpec`` (a JSON schema, any JSON object, a regex, a choice of strings, an
EBNF / Lark grammar) is compiled once per tokenizer (``GrammarCompiler``, cached by spec); each
sequence gets its own ``GrammarMatcher``, which holds the grammar's state after the sequence's
output tokens. Terms:

* *mask*: the tokens the grammar allows next; the others get -inf in the target's logits, so the
  verifier judges by the *masked target*, the distribution plain constrained decoding samples.
* *rows*: for a draft d_1..d_K, verification row j scores the token after d_1..d_j; its mask is
  the grammar's after the matcher has consumed d_1..d_j (tentatively: ``masks`` rolls back).
* *cut*: a draft is cut before its first token the grammar rejects (``allowed_prefix``), before
  the target's pass, so no row is spent on it (that token would be rejected anyway: p = 0).
* *draft masks*: a draft model samples its tokens under the grammar too: at each draft step the
  matcher gives the mask of the state after the draft's own tokens so far (``mask``), the draft's
  logits are masked with it, the sampled token is consumed, and after the draft the matcher rolls
  back (``rollback``). The q handed to the verifier is the masked one the draft sampled from.
* *forced tokens* (llguidance's fast-forward tokens): where the grammar allows exactly one
  continuation (a schema's keys and punctuation), its tokens are proposed as drafts for free.
  They are point masses (q = 1) and are verified like any draft, so they stay lossless even where
  the masked target would have spelled the same bytes with other tokens.

The library is llguidance, picked by measurement against xgrammar 0.2.9 on this CPU (AMD EPYC,
2 cores; a 6-property nested schema; median / max time of one next-token mask over a 58-61 token
instance): llguidance 1.9.1 takes 0.016 / 1.4 ms a mask on SmolLM2's 49k vocabulary and 0.030 /
0.8 ms on Qwen's 152k, compiles a schema lazily (a small schema's matcher and first mask: 3 ms and
17 ms) and its tokenizer in 0.3 s and 1.1 s; xgrammar takes 0.005 / 0.2 ms and 0.004 / 0.5 ms a mask, 39 ms and
88 ms a schema, 0.3 s and 1.7 s a tokenizer. Both are far below a target pass (tens of ms), but
xgrammar, given this tokenizer, let control tokens such as ``<|im_start|>`` into a JSON string
(llguidance reads which tokens are special from the tokenizer's own JSON), and it pulls in
triton; llguidance is one small wheel with no dependency.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from quickdraft.errors import QuickdraftError

# The JSON a schema compiles to has no free whitespace and OpenAI's compact separators: one way to
# write each value, so that keys, quotes and punctuation are forced tokens (free drafts).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CACHED = 64  # compiled grammars kept per tokenizer


class StructuredOutputError(QuickdraftError):
    """A schema, regex or grammar that does not compile (a 400)."""


@dataclass(frozen=True)
class StructuredSpec:
    """What the output must match. ``kind``: "json" (``value``: a JSON schema as JSON
    text; ``{"type": "object"}`` for OpenAI's json_object), "regex", "choice" (a JSON list of
    strings), "grammar" (EBNF as llama.cpp's GBNF, or Lark) or "lark" (llguidance's Lark, with
    ``%json`` blocks: how tool calls are enforced)."""

    kind: str
    value: str
    param: str = "response_format"  # the request field it came from, for error messages

    KINDS = ("json", "regex", "choice", "grammar", "lark")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise StructuredOutputError(f"unknown structured output kind {self.kind!r}; valid: {', '.join(self.KINDS)}",
                                        self.param)

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format") -> StructuredSpec:
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param)
        return cls("json", json.dumps(schema, ensure_ascii=False), param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> StructuredSpec:
        return cls.json_schema({"type": "object"}, param)

    @classmethod
    def choice(cls, options: list[str], param: str = "structured_outputs") -> StructuredSpec:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise StructuredOutputError(f"{param}: choice must be a non-empty list of non-empty strings", param)
        return cls("choice", json.dumps(list(options), ensure_ascii=False), param)

    def grammar_text(self) -> str:
        """llguidance's grammar for this spec (not yet checked: ``GrammarCompiler.compile``)."""
        import llguidance

        try:
            if self.kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(self.value, overrides=JSON_OPTIONS)
            if self.kind == "lark":
                return llguidance.LLMatcher.grammar_from_lark(self.value)
            return llguidance.grammar_from(self.kind, self.value)
        except ValueError as e:
            raise StructuredOutputError(f"{self.param}: the {self.kind} does not compile: {e}", self.param) from None


class GrammarCompiler:
    """Compiles specs for one tokenizer, over a model vocabulary of ``vocab_size`` logits (Qwen
    pads its head past the tokenizer: those ids are never allowed). Thread safe: the server
    compiles on the HTTP thread, to answer a bad schema with a 400, and the engine thread builds
    matchers from the same cache."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # (kind, value) -> pristine LLMatcher

    def _ll_tokenizer(self):
        if self._ll is None:  # ~0.3 s (SmolLM2) to 1 s (Qwen): once, on the first structured request
            import llguidance

            self._ll = llguidance.LLTokenizer(self.tokenizer._tok.to_str(), n_vocab=self.vocab_size,
                                              eos_token=list(self.tokenizer.eos_token_ids))
        return self._ll

    def compile(self, spec: StructuredSpec):
        """A pristine matcher for ``spec`` (cached); StructuredOutputError if it does not compile."""
        import llguidance

        key = (spec.kind, spec.value)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            grammar = spec.grammar_text()
            matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
            if matcher.is_error():
                raise StructuredOutputError(f"{spec.param}: the {spec.kind} does not compile: {matcher.get_error()}",
                                            spec.param)
            self._cache[key] = matcher
            if len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
            return matcher

    def matcher(self, spec: StructuredSpec) -> GrammarMatcher:
        return GrammarMatcher(self.compile(spec).deep_copy(), self.vocab_size)


class GrammarMatcher:
    """One sequence's grammar state: it has consumed exactly the sequence's output tokens."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._bits = torch.arange(32, dtype=torch.int32)  # [32]

    def allowed_prefix(self, drafts: list[int]) -> int:
        """How many of ``drafts`` the grammar accepts in a row from here (nothing is consumed)."""
        return self._m.validate_tokens(drafts) if drafts else 0

    def masks(self, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, vocab_size] bool: row j, the tokens allowed after ``drafts[:j]``.
        ``drafts`` must be an ``allowed_prefix``; the matcher is left as it was. A row where the
        grammar allows nothing (it stopped, or errored) allows nothing: the caller falls back."""
        words = torch.zeros(len(drafts) + 1, self._words, dtype=torch.int32)  # [K + 1, W]
        for j in range(len(drafts) + 1):
            row = words[j]
            self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            if j < len(drafts) and not self._m.consume_token(drafts[j]):
                raise RuntimeError(f"grammar rejected draft token {drafts[j]} that it had validated: {self._m.get_error()}")
        if drafts:
            self._m.rollback(len(drafts))
        return self._unpack(words)

    def mask(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens allowed next (none once the grammar has stopped)."""
        words = torch.zeros(1, self._words, dtype=torch.int32)  # [1, W]
        if not self._m.is_stopped():
            self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        return self._unpack(words)[0]

    def _unpack(self, words: torch.Tensor) -> torch.Tensor:
        """[n, W] int32 bitmasks -> [n, vocab_size] bool."""
        bits = (words.unsqueeze(-1) >> self._bits) & 1  # [n, W, 32]
        return bits.reshape(words.shape[0], -1)[:, : self.vocab_size].bool()

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces from here (its only continuation). They are
        the forced bytes tokenized, which the grammar need not accept token by token (a special
        token spelled as text): only the prefix it accepts is kept."""
        if limit <= 0 or self._m.is_stopped():
            return []
        tokens = self._m.compute_ff_tokens()[:limit]
        return tokens[: self.allowed_prefix(tokens)]

    def advance(self, token: int) -> bool:
        """Consume an emitted token; False if the grammar did not allow it (then it is in error)."""
        return self._m.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` ``advance``s: a draft model walks the grammar along its own
        draft tokens (proposers/draft/model.py) and steps back before verification."""
        if num_tokens:
            self._m.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows nothing more but the end of sequence."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


def apply_masks(rows: torch.Tensor, masks: torch.Tensor, eos_ids) -> None:
    """``rows`` [n, V] float32 logits, in place: -inf where ``masks`` [n, V] bool is False. A row
    with no allowed token (a grammar in error) keeps the end-of-sequence ids instead, so that it
    ends rather than samples from nothing."""
    empty = ~masks.any(-1)  # [n]
    if bool(empty.any()) and eos_ids:
        masks = masks.clone()
        masks[empty.nonzero().squeeze(1).unsqueeze(1), torch.tensor(list(eos_ids)).unsqueeze(0)] = True
    rows.masked_fill_(~masks, float("-inf"))
