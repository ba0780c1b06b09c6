"""server/limits.py without a server: the depth scan against a parse, the Unicode walk, and the
prompt bound against real tokenizations."""

from __future__ import annotations

import json
import random

import pytest

from quickdraft.server import limits
from quickdraft.server.limits import PromptBound, check_unicode, json_depth
from quickdraft.server.protocol import APIError


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def _value(rnd: random.Random, level: int):
    """Nested JSON whose strings are full of brackets, quotes and backslashes."""
    r = rnd.random()
    if level > 6 or r < 0.3:
        return rnd.choice(["[", "]", "{", "}", "\\", '"', "a", '\\"', "\\\\"]) * rnd.randint(0, 4) if r < 0.2 else 7
    if r < 0.65:
        return [_value(rnd, level + 1) for _ in range(rnd.randint(0, 3))]
    return {rnd.choice(["k[", 'x\\"', "\\", "}"]) + str(i): _value(rnd, level + 1) for i in range(rnd.randint(0, 3))}


@pytest.mark.parametrize("window", [limits._WINDOW, 1, 7])
def test_json_depth_is_the_parsed_depth(monkeypatch, window):
    """Brackets inside strings (after escaped quotes and escaped backslashes) do not count; the
    state carries across windows of any size."""
    monkeypatch.setattr(limits, "_WINDOW", window)
    rnd = random.Random(0)
    for _ in range(1500):
        value = _value(rnd, 0)
        raw = json.dumps(value).encode()
        assert json_depth(raw) == _depth(value), raw


def test_json_depth_of_hostile_shapes():
    assert json_depth(b"[" * 10_000) == 10_000
    assert json_depth(b"") == 0 and json_depth(b"7") == 0
    # a string of escaped quotes that never ends: linear (a regex over strings backtracks here)
    assert json_depth(b'["' + b'\\"' * 1_000_000 + b"[[[") == 1


def test_check_unicode_names_the_field():
    raw = b'{"a": [{"b": "ok"}, {"c": "\\ud800"}]}'
    with pytest.raises(APIError) as e:
        check_unicode(raw, json.loads(raw))
    assert e.value.param == "a.1.c" and e.value.status_code == 400
    pair = b'{"a": "\\ud83d\\ude00"}'  # a surrogate pair is one valid character
    check_unicode(pair, json.loads(pair))


class _Bytes:
    """A tokenizer with a vocabulary of token lengths only."""

    def __init__(self, lengths):
        self.lengths = lengths
        self.vocab_size = len(lengths)

    def token_bytes(self, i: int) -> bytes:
        return b"x" * self.lengths[i]


def test_prompt_bound_arithmetic():
    bound = PromptBound(_Bytes([1, 3, 5]), max_model_len=10)
    assert bound.longest == 5
    assert bound.min_tokens("x" * 199) == 9  # 199 bytes / (5 bytes * 4)
    bound.check("x" * 199, "prompt")
    with pytest.raises(APIError) as e:
        bound.check("é" * 100, "prompt")  # 200 bytes: 10 tokens at least
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded" and "at least 10 tokens" in e.value.message


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2_tokenizer", "qwen05_tokenizer"])
def test_prompt_bound_is_below_the_real_count(request, name):
    """Real tokenizers (Qwen's normalizes with NFC): on texts made to tokenize into few tokens
    (the longest tokens repeated, long runs of one character, decomposed accents that NFC
    composes), the bound stays at or under the real count."""
    tok = request.getfixturevalue(name)
    bound = PromptBound(tok, max_model_len=4096)
    longest = sorted(range(tok.vocab_size), key=lambda i: -len(tok.token_bytes(i)))[:20]
    texts = [tok.decode([i] * 50, skip_special_tokens=False) for i in longest]
    texts += [" " * 5000, "\n" * 5000, "a" * 5000, "é" * 3000, "😀" * 2000, "the " * 2000,
              "e\u0301" * 3000, "\u1100\u1161\u11a8" * 2000, "\u03b1\u0313\u0342\u0345" * 1000]
    for text in texts:
        assert bound.min_tokens(text) <= len(tok.encode(text)), text[:40]
