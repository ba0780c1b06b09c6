"""Text <-> token ids, and the chat template, for GGUF files and Hugging Face directories.

A ``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (the Rust library behind Hugging Face's fast
tokenizers) and adds what the model files say around it: which ids end a turn, whether a BOS id
is prepended, and the Jinja chat template.

A GGUF file names its tokenizer in ``tokenizer.ggml.model``; quickdraft reads the two that llama.cpp
calls BPE and SPM (``src/llama-vocab.cpp``):

* ``gpt2``: *byte-level BPE* (GPT-2, Qwen, SmolLM, Llama 3). Every token is spelled in GPT-2's
  byte alphabet, text is first cut into words by a split regex named by ``tokenizer.ggml.pre``,
  and merges are applied in the order ``tokenizer.ggml.merges`` lists them.
* ``llama``: *SentencePiece BPE* (Llama 2, Mistral, Gemma 1-3). Tokens are UTF-8 text with ``▁``
  (U+2581) for a space, bytes with no token of their own are ``<0xNN>`` *byte tokens*, and there
  are no merges: the file gives each token a *score*, and the text is encoded by merging, again and
  again, the adjacent pair whose concatenation is the token with the highest score (llama.cpp's
  ``llm_tokenizer_spm``, after SentencePiece's ``bpe_model.cc``).

Terms: *control* tokens (GGUF token type 3) are special tokens such as ``<|im_start|>``; they are
matched whole in the text and dropped by ``decode(skip_special_tokens=True)``. *User-defined*
tokens (type 4, e.g. ``<tool_call>``, or Gemma's runs of spaces and newlines) are matched whole too
but are ordinary text when decoding. *Unknown* tokens (type 2, SentencePiece's ``<unk>``) are
treated as control tokens, as llama.cpp does.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from quickdraft.errors import ModelFormatError, QuickdraftError

# llama.cpp's token types (llama_token_type): what tokenizer.ggml.token_type holds.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPECIAL_TYPES = (UNKNOWN, CONTROL)  # matched whole in the text and skipped by decode(skip_special_tokens)

SPACE = "\u2581"  # "▁": how SentencePiece vocabularies spell a space

# Split patterns of the byte-level BPE families we know, by ``tokenizer.ggml.pre`` (llama.cpp's
# llm_tokenizer_bpe lists them; a family's patterns are applied one after another, each cutting the
# pieces the previous one left, and the text between matches stays a piece of its own).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's tokenizer.json writes the contractions as (?i:'s|...); llama.cpp spells the cases out
# ('[sS]|...), which differs only where Unicode case folding reaches beyond ASCII: (?i:'s) also
# matches "'ſ" (U+017F). We follow llama.cpp, the reference the engine's ids are compared with.
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: what a byte-level file that says "default" (or, in older
# files, nothing) is split with. Runs of punctuation first, then GPT-2's pattern, then every run of
# digits apart from what precedes it, cut into threes from the left.
_DEFAULT_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)
_SPLITS = {"qwen2": (_QWEN2_SPLIT,), "deepseek-r1-qwen": (_QWEN2_SPLIT,),
           "llama-bpe": (_LLAMA3_SPLIT,), "llama3": (_LLAMA3_SPLIT,), "llama-v3": (_LLAMA3_SPLIT,),
           "default": _DEFAULT_SPLITS}
_GPT2_PRE = ("gpt2", "gpt-2")  # GPT-2's own pattern, which tokenizers' ByteLevel applies
_SMOLLM_PRE = "smollm"
# llama.cpp sets these for the Llama 3 family: a word that is a token as a whole is that token,
# whatever the merges would make of it (ignore_merges), and BOS is prepended unless the file says not.
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")
BYTE_LEVEL_PRE = (*_SPLITS, *_GPT2_PRE, _SMOLLM_PRE)  # every tokenizer.ggml.pre we read

# tokenizer.ggml.model values we read, and what they are.
TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}

# Tokens that end a turn in common chat formats. llama.cpp stops on any "end of generation"
# token, not only on tokenizer.ggml.eos_token_id: SmolLM2's eos is <|im_end|>, but a base-style
# continuation ends with <|endoftext|>; Qwen's eos is <|im_end|> and <|endoftext|> ends raw text;
# Gemma's eos is <eos>, and a chat turn ends with <end_of_turn>; Llama 3's eos is <|end_of_text|>
# or <|eot_id|>, and a tool call's message ends with <|eom_id|>. (llama.cpp's list also has "</s>",
# which Gemma 3 uses as an ordinary HTML tag, user-defined: we leave it out, a Llama 2 file names
# its </s> in eos_token_id anyway.)
_EOG_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>",
               "<|end_of_text|>")


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes stand for
    themselves, the other 68 bytes are shifted to code points 256 and up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = (b for b in range(256) if b not in keep)
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return table


@lru_cache(maxsize=1)
def _byte_values() -> dict[str, int]:
    """_byte_alphabet reversed: printable character -> byte."""
    return {ch: b for b, ch in _byte_alphabet().items()}


def _byte_spelling(token: str) -> str:
    """A token as byte-level BPE spells it; tokens already in the byte alphabet are unchanged."""
    alphabet = _byte_alphabet()
    if set(token) <= set(alphabet.values()):
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str, source: str) -> tuple[Any, Any]:
    """(normalizer, pre-tokenizer) for the byte-level BPE ``tokenizer.ggml.pre`` value ``pre``."""
    if pre in _SPLITS:
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in _SPLITS[pre]]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        # Qwen's own tokenizer.json normalizes to NFC before splitting; llama.cpp does not.
        normalizer = normalizers.NFC() if _SPLITS[pre][0] is _QWEN2_SPLIT else None
        return normalizer, pre_tokenizers.Sequence([*splits, byte_level])
    if pre == _SMOLLM_PRE:
        # SmolLM splits every digit on its own, then GPT-2's regex.
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _GPT2_PRE:
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp refuses a pre-tokenizer it does not know too: splitting the text some other way
    # than the vocabulary was trained on gives other ids, silently.
    raise ModelFormatError(
        f"{source}: tokenizer.ggml.pre is {pre!r}, a byte-level BPE pre-tokenizer quickdraft does not know "
        f"(supported: {', '.join(BYTE_LEVEL_PRE)})"
    )


def _added_tokens(tok: tokenizers.Tokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Make the control, unknown and user-defined tokens of a GGUF vocabulary match whole in the
    text (llama.cpp's ``tokenizer_st_partition`` cuts them out before anything else; both take the
    longest at the leftmost place), in the file's spelling: tokenizers matches them against the
    raw text, before the normalizer."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k in _SPECIAL_TYPES])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])


def _bpe_from_gguf(meta: Mapping[str, Any], source: str) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer from ``tokenizer.ggml.{tokens,token_type,merges,pre}``."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    added = {i for i, t in enumerate(types) if t in (*_SPECIAL_TYPES, USER_DEFINED)}
    # Added tokens keep the file's spelling: tokenizers matches them against the raw text.
    vocab = {(tok if i in added else _byte_spelling(tok)): i for i, tok in enumerate(tokens)}
    try:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    except KeyError:
        raise ModelFormatError(f"{source}: byte-level BPE tokenizer without tokenizer.ggml.merges") from None
    pre = str(meta.get("tokenizer.ggml.pre", "default"))  # llama.cpp's choice for a file that names none
    normalizer, pre_tokenizer = _pre_tokenizer(pre, source)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                          ignore_merges=pre in _LLAMA3_PRE))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    _added_tokens(tok, tokens, types)
    return tok


def _required(meta: Mapping[str, Any], key: str, source: str, kind: str, n: int) -> list:
    """``meta[key]``, a list of at least ``n`` values (one per token), or a ModelFormatError."""
    value = meta.get(key)
    if value is None:
        raise ModelFormatError(f"{source}: {kind} tokenizer without {key}")
    if len(value) < n:
        raise ModelFormatError(f"{source}: {key} has {len(value)} values for {n} tokens")
    return list(value[:n])


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)


def _byte_token(b: int) -> str:
    """SentencePiece's spelling of byte ``b`` as a token of its own: ``<0x0A>`` for a newline."""
    return f"<0x{b:02X}>"


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """BPE merges under which tokenizers' BPE encodes as llama.cpp's ``llm_tokenizer_spm`` does.

    That algorithm starts from the text's characters and, while any two adjacent symbols
    concatenate to a token, merges the pair whose token has the highest score. A BPE model merges
    the adjacent pair that comes first in its merge list instead. So the list holds every way of
    cutting every token in two known tokens, ordered by the token's score, best first: the pair
    BPE takes is then the one SentencePiece takes. Where scores tie, llama.cpp takes the leftmost
    pair and BPE the one listed first (here: the lower token id, then the shorter left part); the
    two differ only where two such pairs overlap (``ab|a`` against ``a|ba`` in ``aba``).
    """
    ranked = []
    for i, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut))
    ranked.sort()
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]


def _spm_from_gguf(meta: Mapping[str, Any], source: str) -> tokenizers.Tokenizer:
    """A SentencePiece BPE tokenizer from ``tokenizer.ggml.{tokens,scores,token_type,add_space_prefix}``.

    Text is encoded as llama.cpp encodes it (``llama_vocab::impl::tokenize``, type SPM): control,
    unknown and user-defined tokens are cut out of the raw text first; each stretch of text between
    them gets a leading space when ``tokenizer.ggml.add_space_prefix`` says so (true unless the
    file says otherwise: Llama 2 and Mistral prefix one, Gemma does not), its spaces become ``▁``,
    and it is merged by score (``_spm_merges``); a character no token spells becomes the byte
    tokens of its UTF-8 bytes. Decoding turns ``▁`` back into a space and byte tokens into their
    bytes, and drops the prefixed space again at the start of the text.
    """
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    n = len(tokens)
    scores = [float(x) for x in _required(meta, "tokenizer.ggml.scores", source, "SentencePiece", n)]
    types = [int(x) for x in _required(meta, "tokenizer.ggml.token_type", source, "SentencePiece", n)]
    # llama.cpp ignores tokenizer.ggml.pre for SentencePiece vocabularies; converters write "default".
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre != "default":
        raise ModelFormatError(f"{source}: tokenizer.ggml.pre is {pre!r}; a SentencePiece tokenizer "
                               "(tokenizer.ggml.model 'llama') has none but 'default'")
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if vocab.setdefault(token, i) != i:  # llama.cpp refuses these too
            raise ModelFormatError(f"{source}: token {token!r} is in the vocabulary twice (ids {vocab[token]} and {i})")
    missing = [_byte_token(b) for b in range(256) if _byte_token(b) not in vocab]
    if missing:
        raise ModelFormatError(f"{source}: SentencePiece vocabulary without the byte tokens "
                               f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: text it has no "
                               "token for could not be encoded")
    # BPE starts from the ids of the text's characters: a character with no token of its own turns
    # into byte tokens at once, where llama.cpp would still merge it with a neighbour into a token
    # that holds it. SentencePiece's training never makes such a vocabulary (its pieces are built
    # from its characters), so one that is would be encoded wrongly: refuse it.
    for i, token in enumerate(tokens):
        if types[i] == NORMAL and len(token) > 1 and (orphan := next((c for c in token if c not in vocab), None)):
            raise ModelFormatError(f"{source}: token {token!r} (id {i}) holds {orphan!r}, which is no token of its "
                                   "own; quickdraft cannot encode such a SentencePiece vocabulary as llama.cpp does")
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, vocab),
                                          fuse_unk=False, byte_fallback=True))
    add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    escape = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if add_space_prefix else escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    _added_tokens(tok, tokens, types)
    return tok


_BUILDERS = {"gpt2": _bpe_from_gguf, "llama": _spm_from_gguf}


def _default_add_bos(kind: str, pre: Any) -> bool:
    """Whether llama.cpp prepends BOS where ``tokenizer.ggml.add_bos_token`` is absent: for
    SentencePiece vocabularies and the Llama 3 family (``llama_vocab::impl::load``)."""
    return kind == "llama" or pre in _LLAMA3_PRE


def _eog_ids(tok: tokenizers.Tokenizer, first: Sequence[int | None]) -> tuple[int, ...]:
    """``first`` (the files' eos ids, in order) followed by the known end-of-turn tokens present."""
    ids = [i for i in first if i is not None]
    ids += [i for t in _EOG_TOKENS if (i := tok.token_to_id(t)) is not None]
    return tuple(dict.fromkeys(ids))  # dedupe, keep order: ids[0] is the canonical eos


def _tojson(value: Any, indent: int | None = None) -> str:
    # Jinja's own tojson escapes <, > and & for HTML; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    raise QuickdraftError(f"chat template refused the messages: {message}", param="messages")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """Encode, decode and render chats for one model.

    ``eos_token_ids[0]`` is the file's eos id; the rest are other end-of-turn ids (see
    ``_EOG_TOKENS``). ``vocab_size`` counts added tokens and can be smaller than the model's
    embedding rows (Qwen pads its embedding to a multiple of 128).
    """

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self._compiled: tuple[str, Any] | None = None  # (source, template), compiled on first use

    # --- building -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "GGUF file") -> Tokenizer:
        """From the ``tokenizer.*`` keys of a GGUF file (values already decoded to Python)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind not in _BUILDERS:
            supported = ", ".join(f"{k!r} ({what})" for k, what in TOKENIZER_MODELS.items())
            raise ModelFormatError(f"{source}: tokenizer.ggml.model is {kind!r}; quickdraft reads {supported}")
        tok = _BUILDERS[kind](meta, source)
        # A SentencePiece file that names no BOS or EOS has LLaMA's (1 and 2), as llama.cpp assumes.
        bos, eos = (1, 2) if kind == "llama" else (None, None)
        ends = [meta.get("tokenizer.ggml.eos_token_id", eos), meta.get("tokenizer.ggml.eot_token_id"),
                meta.get("tokenizer.ggml.eom_token_id")]
        pre = meta.get("tokenizer.ggml.pre")
        return cls(
            tok,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id", bos),
            eos_token_ids=_eog_ids(tok, ends),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", _default_add_bos(kind, pre))),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``generation_config.json``,
        ``chat_template.jinja`` where present) of a Hugging Face model directory."""
        path = Path(path)
        try:
            tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise ModelFormatError(f"{path / 'tokenizer.json'}: cannot read the tokenizer ({e})") from e
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        bos = _token_id(tok, cfg.get("bos_token"))
        gen_eos = gen.get("eos_token_id")
        eos = [_token_id(tok, cfg.get("eos_token")), *(gen_eos if isinstance(gen_eos, list) else [gen_eos])]
        # A tokenizer.json whose post-processor prepends BOS (Llama 3) says so only there.
        bos_by_post = bos is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos]
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_ids=_eog_ids(tok, eos),
            add_bos_token=bool(cfg.get("add_bos_token", bos_by_post)),
            chat_template=_hf_chat_template(path, cfg),
        )

    def to_json(self) -> str:
        """Everything needed to rebuild this tokenizer, as one JSON document (for the cache). The
        ``tokenizers`` document is kept as a string: reading it back then skips a Python parse of
        the whole vocabulary (about 0.4 s for Qwen's 151k tokens)."""
        return json.dumps({
            "tokenizer": self._tok.to_str(),
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
        }, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        """The tokenizer ``to_json`` wrote. Models whose ``tokenizers`` documents are equal (a
        target and its draft, whose chat templates may still differ) share one parsed vocabulary:
        parsing 150k tokens takes about half a second, and a vocabulary is never changed once built."""
        d = json.loads(text)
        return cls(
            _parse(d["tokenizer"]),
            bos_token_id=d["bos_token_id"],
            eos_token_ids=d["eos_token_ids"],
            add_bos_token=d["add_bos_token"],
            chat_template=d["chat_template"],
        )

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Whether both give every id the same token (a draft and its target must)."""
        if self._tok is other._tok:  # shared by from_json
            return True
        n = self.vocab_size
        return n == other.vocab_size and all(self.id_to_token(i) == other.id_to_token(i) for i in range(n))

    # --- using ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) become
        their single id. BOS is prepended only when the model file asks for it, and not to a text
        that starts with the BOS token already: a chat template that writes ``{{ bos_token }}``
        (Gemma's, Llama 3's) gives one BOS, as Hugging Face's ``apply_chat_template`` and
        llama.cpp's chat formatting do, not two."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, as ``encode`` gives them but without a BOS id (the Rust
        library spreads the batch over threads)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def fingerprint(self) -> str:
        """sha256 of what maps text to ids: the vocabulary, merges, added tokens, eos and bos."""
        parts = [self._tok.to_str(), json.dumps([self.bos_token_id, list(self.eos_token_ids), self.add_bos_token])]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def added_token_ids(self) -> list[int]:
        """Ids of the added tokens: control tokens (``<|im_start|>``) and user-defined ones."""
        return sorted(self._tok.get_added_tokens_decoder())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _added(self) -> frozenset[int]:
        return frozenset(self.added_token_ids())

    @functools.cached_property
    def _sentencepiece(self) -> bool:
        """Whether tokens are spelled as SentencePiece spells them (``▁`` for a space, ``<0xNN>``
        byte tokens) rather than in GPT-2's byte alphabet: what the decoder undoes says which. Read
        from the tokenizers document, so that it holds for GGUF files, Hugging Face directories and
        the conversion cache alike."""
        decoder = self._tok.decoder
        steps = json.loads(decoder.__getstate__()) if decoder is not None else {}
        steps = steps.get("decoders", [steps])
        return any(step.get("type") == "ByteFallback" for step in steps)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a byte-level BPE token's spelling mapped back to bytes; a
        SentencePiece token's text with ``▁`` as a space, or a byte token's byte; an added token's
        text as UTF-8): what OpenAI's logprobs report as ``bytes``."""
        token = self.id_to_token(token_id) or ""
        if token_id in self._added:
            return token.encode("utf-8")
        if self._sentencepiece:
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">") and _is_hex(token[3:5]):
                return bytes([int(token[3:5], 16)])
            return token.replace(SPACE, " ").encode("utf-8")
        reverse = _byte_values()
        if token and all(ch in reverse for ch in token):
            return bytes(reverse[ch] for ch in token)
        return token.encode("utf-8")

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...])."""
        if self.chat_template is None:
            raise QuickdraftError("this model has no chat template; send a plain prompt instead", param="messages")
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, _compile_template(self.chat_template))
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
        return self._compiled[1].render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos or "",
            eos_token=eos or "",
        )


def _compile_template(source: str):
    # The template comes from the model file, which anyone can publish: render it in Jinja's
    # sandbox, which refuses attribute access to internals (``''.__class__.__mro__``) and,
    # being immutable, refuses to modify the lists and dicts we pass in.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from e


def _token_id(tok: tokenizers.Tokenizer, token: Any) -> int | None:
    """Id of a token given as a string, an int, or tokenizer_config's {"content": ...} form."""
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, int):
        return token
    return tok.token_to_id(token) if isinstance(token, str) else None


def _hf_chat_template(path: Path, cfg: Mapping[str, Any]) -> str | None:
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


@lru_cache(maxsize=4)
def _parse(document: str) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_str(document)
    except Exception as e:  # tokenizers raises a bare Exception; a caller (the cache) handles ValueError
        raise ValueError(f"not a tokenizers document: {e}") from e
