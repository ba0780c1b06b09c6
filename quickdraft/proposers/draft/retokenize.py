"""Text between two tokenizers: how a draft with its own vocabulary follows the target's sequence,
and how its proposals become target token ids (what transformers calls universal assisted
generation; Timor et al. 2025, "Accelerating LLM Inference with Lossless Speculative Decoding
Algorithms for Heterogeneous Vocabularies", section 3).

Terms:

* *text*: the bytes the target's committed tokens spell (``Tokenizer.token_bytes``), special
  tokens as their text (``<|im_start|>``), so a chat template's rendering is what the draft reads.
* *complete*: a byte string's longest prefix that does not end inside a UTF-8 character. A
  byte-level token may hold part of a character; the draft reads only the complete text, and the
  unfinished bytes past it are the *partial* tail, which its proposal must begin with.
* *view*: the draft's own tokenization of the complete text (``DraftView``), kept across steps.
  When the text grows, the view's last ``WINDOW`` tokens and the new text are encoded again and
  the view keeps its old tokens up to the first difference: a word cut at the end of the text
  (``"func"``, then ``"tion"``) becomes the token the whole text gives. The draft's KV cache holds
  the keys of ``DraftView.kv``; what it keeps after a change is the common prefix with the view.
* *conversion*: the draft's greedy tokens decoded to bytes, the committed partial tail removed from
  their front, and the rest encoded with the target's tokenizer behind the text of the target's
  last tokens (so that the first new token is split as the target would split it, after a space
  for instance); the proposal is what follows those tokens when they encode back to themselves,
  else the new text encoded alone.

None of this can change the output: the proposals are verified as point masses (q = 1 on the
token), which the verifier's rule keeps exact for any proposal. It decides only how many are
accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

WINDOW = 8  # view tokens encoded again with the new text, and target tokens the conversion encodes behind it


def complete_len(data: bytes | bytearray) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 character (a lead
    byte whose continuation bytes have not all come)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b < 0x80:
            return n  # ASCII: nothing unfinished after it
        if b >= 0xC0:  # a lead byte: 110xxxxx needs 2 bytes, 1110xxxx 3, 11110xxx 4
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return n if back >= need else n - back
    return n  # only continuation bytes (invalid UTF-8): decoded with replacement characters


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """How many leading items ``a`` and ``b`` share, given that they share the first ``start``."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class DraftView:
    """One sequence as the draft reads it."""

    ids: list[int]  # the draft's tokens of the complete text (its BOS first where it has one)
    ends: list[int]  # [len(ids)] byte offset in ``text`` where each token ends
    fixed: int  # leading ids never encoded again (the BOS)
    text: bytearray = field(default_factory=bytearray)  # the bytes of the target's first num_target tokens
    num_target: int = 0
    kv: list[int] = field(default_factory=list)  # the ids whose keys the draft's cache holds, in order
    exact: bool = True  # the ids spell the text byte for byte (a normalizer may change it: then re-encode all)

    @property
    def covered(self) -> int:
        """Bytes of ``text`` the ids spell."""
        return self.ends[-1] if self.ends else 0


class Bridge:
    """Converts between a target tokenizer and a draft tokenizer, for ``DraftView``s."""

    def __init__(self, target_tok, draft_tok, window: int = WINDOW):
        self.target, self.draft, self.window = target_tok, draft_tok, window
        self._target_bytes: dict[int, bytes] = {}
        self._draft_bytes: dict[int, bytes] = {}
        self.draft_bos = draft_tok.bos_token_id if draft_tok.add_bos_token else None
        self.target_bos = target_tok.bos_token_id if target_tok.add_bos_token else None
        self.draft_stops = frozenset(draft_tok.eos_token_ids)
        # a draft's end of text proposes the target's same-named special token, else its first eos
        target_special = set(target_tok.added_token_ids())
        self._stop_map = {}
        for d in self.draft_stops:
            t = target_tok.token_to_id(draft_tok.id_to_token(d) or "")
            self._stop_map[d] = t if t in target_special else next(iter(target_tok.eos_token_ids), None)

    def new_view(self) -> DraftView:
        if self.draft_bos is None:
            return DraftView([], [], 0)
        return DraftView([self.draft_bos], [0], 1)

    def target_bytes(self, ids: list[int], start: int = 1) -> bytes:
        """The text of target tokens ``ids``, the first of which is at position ``start`` of its
        sequence (a BOS at position 0 the model adds is no text)."""
        cache = self._target_bytes
        out = []
        for pos, t in enumerate(ids, start):
            if pos == 0 and t == self.target_bos:
                continue
            b = cache.get(t)
            if b is None:
                b = cache[t] = self.target.token_bytes(t)
            out.append(b)
        return b"".join(out)

    def draft_bytes(self, ids: list[int]) -> bytes:
        cache = self._draft_bytes
        out = []
        for t in ids:
            b = cache.get(t)
            if b is None:
                b = cache[t] = b"" if t == self.draft_bos else self.draft.token_bytes(t)
            out.append(b)
        return b"".join(out)

    # -- the draft follows the target -------------------------------------------------------
    def follow(self, view: DraftView, target_ids: list[int]) -> None:
        """Bring ``view`` up to the target's committed tokens ``target_ids``: their new text
        appended, the view's tail and the new complete text encoded again, and ``view.kv`` cut to
        what it shares with the new ids."""
        if len(target_ids) > view.num_target:
            view.text += self.target_bytes(target_ids[view.num_target :], view.num_target)
            view.num_target = len(target_ids)
        end = complete_len(view.text)
        if end == view.covered:
            return
        j0 = max(view.fixed, len(view.ids) - self.window) if view.exact else view.fixed
        ids, ends, exact = self._encode(view, j0, end)
        if not exact and j0 > view.fixed:  # the window's offsets are not to be trusted: all of it again
            j0 = view.fixed
            ids, ends, exact = self._encode(view, j0, end)
        view.kv = view.kv[: common_prefix(view.kv, view.ids[:j0] + ids, min(j0, len(view.kv)))]
        view.ids[j0:], view.ends[j0:], view.exact = ids, ends, exact

    def _encode(self, view: DraftView, j0: int, end: int) -> tuple[list[int], list[int], bool]:
        """The draft's ids of text[ends[j0 - 1]:end], their end offsets, and whether they spell
        those bytes exactly (offsets clipped to ``end`` where not)."""
        start = view.ends[j0 - 1] if j0 > 0 else 0
        piece = bytes(view.text[start:end]).decode("utf-8", errors="replace")
        ids = self.draft.encode_batch([piece])[0]
        lens = [len(self.draft_bytes([t])) for t in ids]
        exact = sum(lens) == end - start
        ends = [min(e, end) for e in accumulate(lens, initial=start)][1:]
        if ends:
            ends[-1] = end
        return ids, ends, exact

    # -- the draft's tokens become the target's ----------------------------------------------
    def to_target(self, view: DraftView, target_ids: list[int], draft_ids: list[int]) -> list[int]:
        """Target ids for the draft's continuation ``draft_ids`` of ``view`` (followed up to
        ``target_ids``): the text they add after the committed text, re-encoded; a draft stop
        token last becomes the target's. [] where the continuation does not begin with the
        committed partial tail."""
        stop = None
        if draft_ids and draft_ids[-1] in self.draft_stops:
            stop = self._stop_map[draft_ids[-1]]
            draft_ids = draft_ids[:-1]
        new = self.draft_bytes(draft_ids)
        cut = complete_len(new)
        if cut < len(new):
            new, stop = new[:cut], None  # an unfinished character ends the proposal
        partial = bytes(view.text[view.covered :])
        if not new.startswith(partial):
            return []
        out = self._encode_after(target_ids, partial, new[len(partial) :]) if len(new) > len(partial) else []
        if out is None:
            return []
        return out + [stop] if stop is not None else out

    def _encode_after(self, target_ids: list[int], partial: bytes, new: bytes) -> list[int] | None:
        """Target ids of ``new`` as they follow ``target_ids``: encoded behind the text of the last
        ``window`` target tokens when that text encodes back to them, else on its own (None where
        the committed text ends inside a character: no target token sequence spells the rest)."""
        tail = target_ids[-self.window :] if self.window else []
        first = len(target_ids) - len(tail)
        while tail:  # a window that starts at a character's first byte, not inside one
            lead = self.target_bytes(tail[:1], first)
            if lead and not 0x80 <= lead[0] < 0xC0:
                break
            tail, first = tail[1:], first + 1
        head = self.target_bytes(tail, first)
        text = (head + new).decode("utf-8", errors="replace")
        ids = self.target.encode_batch([text])[0]
        if ids[: len(tail)] == tail:
            return ids[len(tail) :]
        if partial:
            return None
        return self.target.encode_batch([new.decode("utf-8", errors="replace")])[0]
