"""Incremental detokenization: a sequence's text grows by decoding its new tokens only.

Decoding the whole output after every step costs a step time that grows with the output, and a
request's total with its square. Here each update decodes a short *window* instead, as vLLM's
incremental detokenizer does (``detokenize_incrementally``): the tokens from ``prefix`` on, where

* the *committed* text is the decode of ``ids[:read]``: it never changes again;
* ``ids[prefix:read]`` are the tokens of the last commit (or more), decoded again with the new
  ones so that a decoder that looks at the neighbouring token (WordPiece's clean-up joins " ." to
  ".", sentencepiece's byte fallback turns a whole run of byte tokens into U+FFFD where one of
  them is not UTF-8) treats the new tokens as in a full decode;
* the *pending* text is what ``ids[read:]`` add: it ends in U+FFFD while the last token stops in
  the middle of a multi-byte UTF-8 character, and may change once the next token completes it.
  A window whose text does not end in U+FFFD is committed.

``text`` (committed + pending) equals ``decode(ids)`` after every update, byte for byte. For
byte-level BPE (GPT-2's decoder: token bytes joined, then decoded as UTF-8 with replacement) this
holds by construction: text committed ends in a whole character, after which later bytes decode
alone. Other decoders can reach further back; a window whose text no longer begins with its
prefix's text starts again from the first token (a whole decode), so the text stays exact there
too, as far as a change reaches into the window (tests hold it to sentencepiece's and WordPiece's
decoders over random tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what decoding gives for the bytes of an incomplete UTF-8 character


class IncrementalDetokenizer:
    """The text of a growing token list. ``ids`` is the caller's list, only ever appended to;
    ``decode`` maps token ids to text (``Tokenizer.decode``)."""

    def __init__(self, ids: Sequence[int], decode: Callable[[Sequence[int]], str]):
        self._ids = ids
        self._decode = decode
        self._prefix = 0  # first token of the window
        self._read = 0  # tokens whose text is committed
        self._prefix_text = ""  # decode(ids[prefix:read])
        self._committed = ""  # decode(ids[:read])
        self._pending = ""  # what ids[read:] add to the committed text
        self.decoded_tokens = 0  # token ids passed to decode so far (tests count the work with it)

    @property
    def text(self) -> str:
        return self._committed + self._pending if self._pending else self._committed

    def update(self) -> int:
        """Take in the tokens appended since the last update. Returns the length of the text that
        is unchanged since then: a search for a stop string need not look before it."""
        n = len(self._ids)
        unchanged = len(self._committed)
        window = self._window(n)
        if not window.startswith(self._prefix_text):
            self._prefix = self._read = 0
            self._prefix_text = self._committed = ""
            unchanged = 0
            window = self._window(n)
        tail = window[len(self._prefix_text):]
        if tail and not tail.endswith(REPLACEMENT):
            self._commit(tail, window, n)
        else:
            self._pending = tail
        return unchanged

    def _commit(self, tail: str, window: str, n: int) -> None:
        """Commit ``tail``, the text of ids[read:n]. The window moves on to start at ``read``
        where those tokens decode alone to some text, which need not equal ``tail``
        (sentencepiece strips the first space of a decode; WordPiece keeps a first piece's "##"):
        later windows start with the same tokens, so they start with the same text. Where they
        decode to nothing, the window's prefix text would be empty, and the check in ``update``
        could not see a change reach back into it: the window keeps its start."""
        self._committed += tail
        self._pending = ""
        start, self._read = self._read, n
        alone = self._decode(self._ids[start:n])
        self.decoded_tokens += n - start
        if alone:
            self._prefix, self._prefix_text = start, alone
        else:
            self._prefix_text = window

    def _window(self, end: int) -> str:
        ids = self._ids[self._prefix:end]
        self.decoded_tokens += len(ids)
        return self._decode(ids)
