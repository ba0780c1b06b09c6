"""Incremental detokenization (engine/detokenizer.py): after every update the text equals a decode
of all the tokens, byte for byte, on SmolLM2's and Qwen's byte-level BPE tokenizers and on two
decoders that look across tokens (sentencepiece's and WordPiece's); random token sequences and the
token sequences of real texts, fed a few tokens at a time."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models

from quickdraft.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer
from quickdraft.models.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! The café serves crème brûlée for 5€.",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Emoji: 👍🏽 🇫🇷 👨‍👩‍👧‍👦 🤖 and math ∑ ∫ ≤ ≠ √",
    "def f(x):\n    return x ** 2  # squares\n\n\n\tif   x  >  0 :\n        pass",
    "   leading spaces,   runs   of   spaces,\n\n\nand\r\nCRLF  ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nÇa va? ﷽ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def feed(ids: list[int], decode, rng: random.Random) -> None:
    """Append ``ids`` a few at a time; after each update the text is a full decode, and the text
    that update reports as unchanged is unchanged."""
    out: list[int] = []
    detok = IncrementalDetokenizer(out, decode)
    before = ""
    while len(out) < len(ids):
        out += ids[len(out) : len(out) + rng.choice([1, 1, 1, 2, 3, 5])]
        unchanged = detok.update()
        assert detok.text == decode(out), out
        assert detok.text[:unchanged] == before[:unchanged] and unchanged <= len(before)
        before = detok.text


def partial_tokens(tok: Tokenizer) -> list[int]:
    """Ids whose bytes are not whole UTF-8 characters: the pieces of split characters."""
    out = []
    for i in range(tok.vocab_size):
        try:
            tok.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            out.append(i)
    return out


def random_ids(tok: Tokenizer, partial: list[int], rng: random.Random, n: int) -> list[int]:
    """Mostly pieces of split characters (the hard case), some special tokens, the rest anything."""
    special = tok.added_token_ids()
    pools = [partial] * 5 + [special] + [range(tok.vocab_size)] * 4
    return [rng.choice(rng.choice(pools)) for _ in range(n)]


@pytest.fixture(params=["smollm2", "qwen05"])
def tokenizer(request) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tokenizer")


@pytest.mark.parametrize("skip_special", [True, False])
def test_random_tokens_decode_as_a_whole(tokenizer, skip_special):
    rng = random.Random(0)
    partial = partial_tokens(tokenizer)
    assert len(partial) > 100  # the byte-level vocabularies have many
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special)  # noqa: E731
    for _ in range(300):
        feed(random_ids(tokenizer, partial, rng, rng.randint(1, 40)), decode, rng)


def test_real_texts_decode_as_a_whole(tokenizer):
    rng = random.Random(1)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        for _ in range(5):
            feed(ids, tokenizer.decode, rng)


def test_a_character_split_over_tokens_is_pending_until_complete(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("a👍")
    assert len(ids) >= 3  # "a" and the emoji's four bytes in pieces
    out: list[int] = []
    detok = IncrementalDetokenizer(out, smollm2_tokenizer.decode)
    for i, t in enumerate(ids):
        out.append(t)
        detok.update()
        assert detok.text == smollm2_tokenizer.decode(out)
        assert detok.text.endswith(REPLACEMENT) == (0 < i < len(ids) - 1)


def _sentencepiece_like() -> RustTokenizer:
    """Llama 2's decoders: ▁ for a space, <0xNN> byte tokens, the decode's first space stripped."""
    vocab = {"<unk>": 0, "▁the": 1, "▁cat": 2, "▁": 3, "s": 4, ".": 5, "▁é": 6}
    vocab |= {f"<0x{b:02X}>": 7 + b for b in range(256)}
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def _wordpiece() -> RustTokenizer:
    """BERT's decoder: words joined by spaces, ## pieces glued on, " ." and " n't" cleaned up."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "do", "n't", "'", "s", ".", ",", "?", "##s", "##ing", "go", "it"])}
    tok = RustTokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return tok


@pytest.mark.parametrize("build", [_sentencepiece_like, _wordpiece])
def test_decoders_that_look_across_tokens(build):
    tok = build()
    decode = lambda ids: tok.decode(list(ids))  # noqa: E731
    rng = random.Random(2)
    for _ in range(300):
        feed([rng.randrange(tok.get_vocab_size()) for _ in range(rng.randint(1, 30))], decode, rng)


@pytest.mark.parametrize("build", [_sentencepiece_like, _wordpiece])
def test_the_window_stays_short(build):
    """Token by token over 2,000 words, each update decodes a few tokens, never the whole output
    (the window moves on after each commit, also where a decoder strips a space or a run of
    "##" pieces decodes differently without the word it continues)."""
    tok = build()
    # sorted: get_vocab's order changes from process to process
    words = sorted(i for t, i in tok.get_vocab().items() if not t.startswith(("<", "[")) and t != "▁")
    rng = random.Random(3)
    out: list[int] = []
    detok = IncrementalDetokenizer(out, lambda ids: tok.decode(list(ids)))
    most = 0
    for _ in range(2000):
        out.append(rng.choice(words))
        before = detok.decoded_tokens
        detok.update()
        most = max(most, detok.decoded_tokens - before)
    assert detok.text == tok.decode(out) and most <= 4
