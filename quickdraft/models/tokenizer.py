"""Text <-> token ids, and the chat template, for GGUF files and Hugging Face directories.

A ``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (the Rust library behind Hugging Face's fast
tokenizers) and adds what the model files say around it: which ids end a turn, whether a BOS id
is prepended, and the Jinja chat template.

Terms: *control* tokens (GGUF token type 3) are special tokens such as ``<|im_start|>``; they are
matched whole in the text and dropped by ``decode(skip_special_tokens=True)``. *User-defined*
tokens (type 4, e.g. ``<tool_call>``) are matched whole too but are ordinary text when decoding.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from quickdraft.errors import ModelFormatError, QuickdraftError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# Split patterns of the byte-level BPE families we know, by ``tokenizer.ggml.pre``.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
           "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}
_GPT2_PRE = {"default", "gpt2", "gpt-2"}

# Tokens that end a turn in common chat formats. llama.cpp stops on any "end of generation"
# token, not only on tokenizer.ggml.eos_token_id: SmolLM2's eos is <|im_end|>, but a base-style
# continuation ends with <|endoftext|>; Qwen's eos is <|im_end|> and <|endoftext|> ends raw text.
_EOG_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>")


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


def _pre_tokenizer(pre: str) -> tuple[Any, Any]:
    """(normalizer, pre-tokenizer) for ``tokenizer.ggml.pre``."""
    if pre in _SPLITS:
        split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        # Qwen's own tokenizer.json normalizes to NFC before splitting; llama.cpp does not.
        normalizer = normalizers.NFC() if _SPLITS[pre] is _QWEN2_SPLIT else None
        return normalizer, pre_tokenizers.Sequence([split, byte_level])
    if pre == "smollm":
        # SmolLM splits every digit on its own, then GPT-2's regex.
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre not in _GPT2_PRE:
        warnings.warn(f"unknown tokenizer.ggml.pre {pre!r}: splitting text as GPT-2 does", stacklevel=3)
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _bpe_from_gguf(meta: Mapping[str, Any], source: str) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer from ``tokenizer.ggml.{tokens,token_type,merges,pre}``."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    added = {i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)}
    # Added tokens keep the file's spelling: tokenizers matches them against the raw text.
    vocab = {(tok if i in added else _byte_spelling(tok)): i for i, tok in enumerate(tokens)}
    try:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    except KeyError:
        raise ModelFormatError(f"{source}: byte-level BPE tokenizer without tokenizer.ggml.merges") from None
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    normalizer, pre = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in sorted(added) if types[i] == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in sorted(added) if types[i] == USER_DEFINED])
    return tok


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
        if kind != "gpt2":
            raise ModelFormatError(
                f"{source}: tokenizer.ggml.model is {kind!r}; quickdraft reads byte-level BPE ('gpt2') only"
            )
        tok = _bpe_from_gguf(meta, source)
        eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
        return cls(
            tok,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_eog_ids(tok, eos),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
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
        their single id. BOS is prepended only when the model file asks for it."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None:
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

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a byte-level BPE token's spelling mapped back to bytes;
        an added token's text as UTF-8): what OpenAI's logprobs report as ``bytes``."""
        token = self.id_to_token(token_id) or ""
        reverse = _byte_values()
        if token and all(ch in reverse for ch in token) and token_id not in self._added:
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
