"""Streaming text deltas: multi-byte characters split across tokens never leak U+FFFD, and a tail
that may become a stop string is held back. No model weights: the SmolLM2 tokenizer only."""

from __future__ import annotations

import pytest

from quickdraft.server.streaming import REPLACEMENT, IncrementalText, sse

TEXTS = ["héllo wörld 😀🎉 — 世界你好, naïve café ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "emoji only: 🧑‍🚀🏳️‍🌈👍🏽", "日本語のテキストです。"]


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_deltas_against_real_tokenizer(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    inc, deltas, partial_seen = IncrementalText(), [], False
    for n in range(1, len(ids) + 1):
        full = tok.decode(ids[:n])
        partial_seen |= full.endswith(REPLACEMENT)
        deltas.append(inc.delta(full, finished=n == len(ids)))
    assert partial_seen, "the text should split a character across tokens"
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_stop_prefix_is_held_back():
    inc = IncrementalText(stop=("\n\n", "END"))
    assert inc.delta("Hello\n", False) == "Hello"  # "\n" may begin "\n\n"
    assert inc.delta("Hello\nWorld E", False) == "\nWorld "  # "E" may begin "END"
    assert inc.delta("Hello\nWorld Ex", False) == "Ex"
    # the engine cut the text before a stop string: nothing of it was sent
    inc = IncrementalText(stop=("<|",))
    assert inc.delta("ab<", False) == "ab"
    assert inc.delta("ab", True) == ""
    assert inc.sent == "ab"


def test_final_flush_sends_a_real_replacement_char():
    inc = IncrementalText()
    assert inc.delta("bad byte \ufffd", False) == "bad byte "
    assert inc.delta("bad byte \ufffd", True) == "\ufffd"


def test_sse_format():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert sse("[DONE]") == "data: [DONE]\n\n"
