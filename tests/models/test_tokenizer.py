"""Tokenizer: the ids real models expect, agreement with transformers' GGUF tokenizer and with
llama.cpp's algorithms (written out here in plain Python), chat templates rendered in a sandbox,
and the JSON round trip the conversion cache relies on."""

from __future__ import annotations

import heapq
import os
import random
from pathlib import Path

import pytest
from jinja2.exceptions import SecurityError

from quickdraft.errors import ModelFormatError, ModelNotInstalledError, QuickdraftError
from quickdraft.models import registry
from quickdraft.models.gguf import open_gguf, read_metadata
from quickdraft.models.tokenizer import Tokenizer, _byte_alphabet

VARIED = [
    "def fibonacci(n):",
    "    if n < 2:\n        return n\n\treturn [i**2 for i in range(10)]\n\n\n",
    "12345 and 3.14159, 1e-9",
    "héllo wörld — 你好，世界 🚀 naïve café",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "don't I'LL we've  \r\n \n",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write fib in Python."},
    {"role": "assistant", "content": "def fib(n): ..."},
    {"role": "user", "content": "Thanks <3 & bye"},
]


def _hf_gguf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers", reason="pip install transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def qwen05_hf(qwen05_path: Path):
    return _hf_gguf_tokenizer(qwen05_path)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path: Path):
    return _hf_gguf_tokenizer(smollm2_path)


@pytest.mark.slow
def test_qwen_coder_ids(qwen05_tokenizer: Tokenizer) -> None:
    tok = qwen05_tokenizer
    assert tok.encode("def fibonacci(n):") == [750, 75698, 1445, 1648]
    assert tok.encode("<|im_start|>user") == [151644, 872]  # control tokens stay whole
    assert tok.encode("<tool_call>") == [151657]  # user-defined ones too
    assert tok.bos_token_id == 151643 and tok.eos_token_ids == (151645, 151643)  # <|im_end|>, <|endoftext|>
    assert not tok.add_bos_token


@pytest.mark.slow
def test_smollm2_ids(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tok.encode("12345") == [33, 34, 35, 36, 37]  # SmolLM splits digits one by one
    assert tok.eos_token_ids == (2, 0) and tok.bos_token_id == 1


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen05", "smollm2"])
def test_matches_transformers(model: str, request: pytest.FixtureRequest) -> None:
    ours: Tokenizer = request.getfixturevalue(f"{model}_tokenizer")
    theirs = request.getfixturevalue(f"{model}_hf")
    for text in VARIED:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    expected = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT) == expected


@pytest.mark.slow
def test_qwen_template_with_tools(qwen05_tokenizer: Tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "add", "description": "a < b & c", "parameters": {}}}]
    text = qwen05_tokenizer.apply_chat_template(CHAT[1:2], tools=tools)
    assert '"description": "a < b & c"' in text  # tojson writes plain JSON, not HTML-escaped
    assert text.endswith("<|im_start|>assistant\n")
    assert not qwen05_tokenizer.apply_chat_template(CHAT[1:2], add_generation_prompt=False).endswith("assistant\n")


def test_from_hf_dir(tiny_hf_dir) -> None:
    path, _ = tiny_hf_dir
    tok = Tokenizer.from_hf_dir(path)
    assert tok.vocab_size == 260
    assert tok.encode("<|im_start|> t") == [258, 256]
    assert tok.eos_token_ids == (259, 257)  # tokenizer_config's eos, then generation_config's
    assert tok.bos_token_id is None and not tok.add_bos_token
    assert tok.id_to_token(256) == "Ġt" and tok.token_to_id("<|im_end|>") == 259
    assert tok.decode([258, 256, 259]) == " t"
    assert tok.decode([258, 256, 259], skip_special_tokens=False) == "<|im_start|> t<|im_end|>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_json_round_trip(tiny_hf_dir) -> None:
    tok = Tokenizer.from_hf_dir(tiny_hf_dir[0])
    back = Tokenizer.from_json(tok.to_json())
    for attr in ("bos_token_id", "eos_token_ids", "add_bos_token", "chat_template", "vocab_size"):
        assert getattr(back, attr) == getattr(tok, attr), attr
    assert back.encode("<|im_end|> tt\n") == tok.encode("<|im_end|> tt\n")


def _with_template(tiny_hf_dir, template: str) -> Tokenizer:
    tok = Tokenizer.from_hf_dir(tiny_hf_dir[0])
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",  # the classic escape towards subprocess.Popen
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set _ = messages.append({'role': 'x'}) %}",  # immutable: templates cannot edit our input
])
def test_template_is_sandboxed(tiny_hf_dir, template: str) -> None:
    with pytest.raises(SecurityError):
        _with_template(tiny_hf_dir, template).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_variables_and_raise_exception(tiny_hf_dir) -> None:
    tok = _with_template(tiny_hf_dir, "{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ add_generation_prompt }}"
                                      "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}")
    assert tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=False) == "|<|im_end|>|None|False"
    with pytest.raises(QuickdraftError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": ""}])


def test_no_template(tiny_hf_dir) -> None:
    with pytest.raises(QuickdraftError, match="no chat template"):
        _with_template(tiny_hf_dir, None).apply_chat_template([{"role": "user", "content": "hi"}])


# --- SentencePiece (tokenizer.ggml.model "llama"): Gemma 3, Llama 2 ------------------------------


class SpmReference:
    """llama.cpp's SentencePiece encoding (``llama_vocab::impl::tokenize`` for type SPM with
    parse_special, and ``llm_tokenizer_spm``), written out plainly as an oracle: control (3),
    unknown (2) and user-defined (4) tokens are cut out of the text, longest first; each stretch of
    text left gets a leading space if ``add_space_prefix``, its spaces become ▁, and then the
    adjacent pair whose concatenation is the best-scored token (the leftmost on a tie) is merged
    until no pair is a token; a symbol that is no token becomes the byte tokens of its UTF-8."""

    def __init__(self, meta: dict):
        self.tokens, types, self.scores = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores"))
        self.add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.special = sorted((i for i, k in enumerate(types) if k in (2, 3, 4)), key=lambda i: -len(self.tokens[i]))

    def __call__(self, text: str) -> list[int]:
        pieces: list[str | int] = [text] if text else []
        for special in self.special:
            cut: list[str | int] = []
            for piece in pieces:
                if isinstance(piece, int) or self.tokens[special] not in piece:
                    cut.append(piece)
                    continue
                for n, part in enumerate(piece.split(self.tokens[special])):
                    cut += ([special] if n else []) + ([part] if part else [])
            pieces = cut
        out: list[int] = []
        for n, piece in enumerate(pieces):
            if isinstance(piece, int):
                out.append(piece)
                continue
            first = n == 0 or isinstance(pieces[n - 1], int)  # every stretch of text is, in fact
            prefixed = " " + piece if self.add_space_prefix and first else piece
            out += _spm_merge(prefixed.replace(" ", "\u2581"), self.ids, self.scores)
        return out


def _spm_merge(text: str, ids: dict[str, int], scores: list[float]) -> list[int]:
    symbols = list(text)  # a merged-away symbol becomes ""
    after = [*range(1, len(text)), -1] if text else []
    before = list(range(-1, len(text) - 1))
    queue: list[tuple[float, int, int, int]] = []

    def offer(left: int, right: int) -> None:
        if left >= 0 and right >= 0 and (i := ids.get(symbols[left] + symbols[right])) is not None:
            heapq.heappush(queue, (-scores[i], left, right, len(symbols[left]) + len(symbols[right])))

    for i in range(1, len(symbols)):
        offer(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not symbols[left] or not symbols[right] or len(symbols[left]) + len(symbols[right]) != size:
            continue  # one of them was merged since
        symbols[left] += symbols[right]
        symbols[right] = ""
        after[left] = after[right]
        if after[right] >= 0:
            before[after[right]] = left
        offer(before[left], left)
        offer(left, after[left])
    out = []
    for symbol in symbols:
        if symbol:
            out += [ids[symbol]] if symbol in ids else [ids[f"<0x{b:02X}>"] for b in symbol.encode("utf-8")]
    return out


# Gemma 3 as its GGUF says: model "llama", pre "default", no space prefix, 262,144 tokens whose
# user-defined ones include runs of 2-31 spaces (real spaces), of newlines and of tabs, and HTML tags.
GEMMA_TEXTS = [
    *VARIED,
    "<start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\n",
    "\x00\x01\x7f controls, \u0378 unassigned, \U000e0001 a tag, \ufeff a BOM: bytes no token spells",
    "👨\u200d👩\u200d👧\u200d👦🇫🇷👍🏽 and Ελληνικά русский العربية हिन्दी 日本語 한국어 ไทย",
    "<b>bold</b> <table><tr><td>x</td></tr></table> <s> strike </s> <unused0><mask>[multimodal]",
    "\t\tindent\t\t\t\ttabs\t  and   spaces \n\n\n\n",
    "abababababa hahahaha aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa <0x41> is no byte token in text",
    " leading space, trailing space ",
]
# Runs of more than 31 spaces: llama.cpp cuts them into its user-defined tokens of real spaces,
# longest first ("a" + 40 spaces: 31 + 9). transformers renames those tokens to runs of ▁ and lets
# its merges cut the run (16 + 24), so only llama.cpp's oracle judges these.
GEMMA_LLAMA_CPP_ONLY = ["a" + " " * 40 + "b" + " " * 33 + "c", "def f():\n" + " " * 64 + "return 1"]
GEMMA3_IT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    """Gemma 3 270M, base, Q4_K_M (253 MB, gemma3 arch): its tokenizer, not its weights."""
    try:
        return registry.model_path("gemma3-270m")
    except ModelNotInstalledError as e:
        if os.environ.get("CI"):  # `make install` installs it
            pytest.fail(str(e))
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def gemma_meta(gemma_path: Path) -> dict:
    return read_metadata(open_gguf(gemma_path))  # about 13 s: 262,144 tokens


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_meta: dict, gemma_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gemma_meta, str(gemma_path))


@pytest.fixture(scope="module")
def gemma_hf(gemma_path: Path):
    return _hf_gguf_tokenizer(gemma_path)


@pytest.mark.slow
def test_gemma_ids(gemma_meta: dict, gemma_tokenizer: Tokenizer) -> None:
    tok = gemma_tokenizer
    assert (gemma_meta["tokenizer.ggml.model"], gemma_meta["tokenizer.ggml.pre"]) == ("llama", "default")
    assert gemma_meta["tokenizer.ggml.add_space_prefix"] is False and "tokenizer.chat_template" not in gemma_meta
    assert tok.vocab_size == 262144 and tok.add_bos_token and tok.bos_token_id == 2
    assert tok.eos_token_ids == (1, 106)  # <eos>, then <end_of_turn>
    assert tok.encode("Hello world") == [2, 9259, 1902]  # no space before "Hello": Gemma adds no prefix
    assert tok.encode("<start_of_turn>user\n") == [2, 105, 2364, 107]  # control and user-defined tokens whole
    assert tok.encode("  x\t") == [2, 138, 236781, 255968]  # two real spaces and a tab: user-defined tokens
    assert tok.encode("\u0378") == [2, 238 + 0xCD, 238 + 0xB8]  # no token: its UTF-8 bytes, <0xCD><0xB8>
    assert tok.encode("<bos>Hi") == [2, 10979]  # one BOS, not two
    with pytest.raises(QuickdraftError, match="no chat template"):  # the base model's file has none
        tok.apply_chat_template(CHAT)


@pytest.mark.slow
def test_gemma_matches_llama_cpp_and_transformers(gemma_meta: dict, gemma_tokenizer: Tokenizer, gemma_hf) -> None:
    tok = gemma_tokenizer
    reference = SpmReference(gemma_meta)
    for text in GEMMA_TEXTS + GEMMA_LLAMA_CPP_ONLY:
        ids = tok.encode(text)
        assert ids[0] == 2 and ids[1:] == reference(text), text
        if text not in GEMMA_LLAMA_CPP_ONLY:
            assert ids == gemma_hf.encode(text), text
            assert tok.decode(ids) == gemma_hf.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text
        # token_bytes spell the text (Gemma adds no prefix space to strip)
        assert b"".join(tok.token_bytes(i) for i in ids[1:]) == text.encode("utf-8"), text
    assert tok.decode(tok.encode("<start_of_turn>user\nHi<end_of_turn>")) == "user\nHi"  # control tokens skipped


@pytest.mark.slow
def test_gemma_random_text_matches_llama_cpp(gemma_meta: dict, gemma_tokenizer: Tokenizer) -> None:
    reference = SpmReference(gemma_meta)
    rng = random.Random(0)
    alphabet = [*"abcdefghijklmnop ABC  \n\t.,;:'\"()[]{}<>/_-+=0123456789éüß你好世界🚀∑\u2581",
                "<b>", "</s>", "<start_of_turn>", "   "]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert gemma_tokenizer.encode(text)[1:] == reference(text), text


@pytest.mark.slow
def test_gemma_instruct_template(gemma_tokenizer: Tokenizer, gemma_hf) -> None:
    """The 270M base file has no template; an instruct file's (Gemma 3's) renders, with the system
    message folded into the first user turn and the assistant called "model"."""
    tok = Tokenizer.from_json(gemma_tokenizer.to_json())
    tok.chat_template = GEMMA3_IT_TEMPLATE
    text = tok.apply_chat_template(CHAT)
    assert text == ("<bos><start_of_turn>user\nYou are terse.\n\nWrite fib in Python.<end_of_turn>\n"
                    "<start_of_turn>model\ndef fib(n): ...<end_of_turn>\n"
                    "<start_of_turn>user\nThanks <3 & bye<end_of_turn>\n<start_of_turn>model\n")
    gemma_hf.chat_template = GEMMA3_IT_TEMPLATE
    assert text == gemma_hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text)
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1  # the template's <bos>, and no second one
    assert ids == gemma_hf.encode(text, add_special_tokens=False)
    assert not tok.apply_chat_template(CHAT[1:2], add_generation_prompt=False).endswith("model\n")
    with pytest.raises(QuickdraftError, match="must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


@pytest.mark.slow
def test_gemma_json_round_trip(gemma_tokenizer: Tokenizer) -> None:
    tok = gemma_tokenizer
    back = Tokenizer.from_json(tok.to_json())
    assert back.fingerprint() == tok.fingerprint() and back.eos_token_ids == tok.eos_token_ids
    for text in GEMMA_TEXTS:
        ids = tok.encode(text)
        assert back.encode(text) == ids and back.decode(ids) == tok.decode(ids)
        assert [back.token_bytes(i) for i in ids] == [tok.token_bytes(i) for i in ids]
    assert back.token_bytes(238 + 0x0A) == b"\n" and back.token_bytes(back.token_to_id("\u2581the")) == b" the"
    assert back.token_bytes(105) == b"<start_of_turn>"


def _tiny_spm_meta(**extra) -> dict:
    """A SentencePiece vocabulary as a Llama 2 GGUF holds one (no add_space_prefix, add_bos_token,
    bos or eos keys: llama.cpp's defaults apply), scores falling with the id."""
    pieces = ["\u2581", "\u2581t", "he", "\u2581the", "\u2581c", "at", "\u2581cat", "s", "t", "h", "e", "c",
              "a", "\u2581a", "\u2581s", "at\u2581", "\u2581\u2581", "o", "n", "on", "\u2581on", "b", "ab", "ba", "aba", "é"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, "<tool>", "<|turn|>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), 4, 3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": scores, **extra}


SPM_TEXTS = ["the cat", " the  cat sat", "the<|turn|>the cat<tool>cats", "", "héllo 12 x\n", "  ", "on\non",
             "ababa abab", "<s>the", "<unk>", "\u2581the"]


@pytest.mark.parametrize("prefix", [True, False])
def test_spm_matches_llama_cpp(prefix: bool) -> None:
    meta = _tiny_spm_meta(**({} if prefix else {"tokenizer.ggml.add_space_prefix": False}))
    tok = Tokenizer.from_gguf_metadata(meta, "tiny.gguf")
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.add_bos_token  # llama.cpp's SPM defaults
    reference = SpmReference(meta)
    for text in SPM_TEXTS:
        ids = tok.encode(text)
        expected = reference(text)
        assert ids == ([1] if expected[:1] != [1] else []) + expected, text
        if "<" not in text and "\u2581" not in text:  # the prefixed space is taken off again (a ▁ typed is a space)
            assert tok.decode(ids) == text and tok.decode(ids[1:]) == text, text
    rng = random.Random(1)
    for _ in range(300):
        text = "".join(rng.choice(["the", " ", "cat", "a", "b", "é", "ü", "<tool>", "<s>", "\n", "on"])
                       for _ in range(rng.randint(0, 12)))
        expected = reference(text)
        assert tok.encode(text) == ([1] if expected[:1] != [1] else []) + expected, text


def test_spm_prefix_follows_special_tokens() -> None:
    """llama.cpp puts the space before every stretch of text, also the ones after a special or
    user-defined token (transformers' Llama tokenizer only before the first)."""
    tok = Tokenizer.from_gguf_metadata(_tiny_spm_meta(), "tiny.gguf")
    pieces = [tok.id_to_token(i) for i in tok.encode("the<|turn|>the<tool>cat")]
    assert pieces == ["<s>", "\u2581the", "<|turn|>", "\u2581the", "<tool>", "\u2581cat"]
    assert tok.decode(tok.encode("the<|turn|>cat")) == "the cat"  # <|turn|> skipped, its text space kept


def test_spm_bytes_and_json_round_trip() -> None:
    tok = Tokenizer.from_gguf_metadata(_tiny_spm_meta(), "tiny.gguf")
    ids = tok.encode("cat ü")
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "\u2581cat", "\u2581", "<0xC3>", "<0xBC>"]
    assert [tok.token_bytes(i) for i in ids] == [b"<s>", b" cat", b" ", b"\xc3", b"\xbc"]
    back = Tokenizer.from_json(tok.to_json())
    assert back.encode("cat ü") == ids and back.decode(ids) == "cat ü" and back.token_bytes(ids[-1]) == b"\xbc"
    assert back.add_bos_token and back.bos_token_id == 1 and back.added_token_ids() == tok.added_token_ids()


@pytest.mark.parametrize("meta, match", [
    ({"tokenizer.ggml.model": "bert"}, r"tiny\.gguf: tokenizer\.ggml\.model is 'bert'; quickdraft reads 'gpt2'.*'llama'"),
    ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model is None"),
    (_tiny_spm_meta(**{"tokenizer.ggml.scores": None}), "tiny.gguf: SentencePiece tokenizer without tokenizer.ggml.scores"),
    (_tiny_spm_meta(**{"tokenizer.ggml.token_type": [1] * 10}), "token_type has 10 values for 287 tokens"),
    ({**_tiny_spm_meta(), "tokenizer.ggml.tokens": [*_tiny_spm_meta()["tokenizer.ggml.tokens"][:-3], "éx", "<tool>",
                                                    "<|turn|>"]}, r"token 'éx' \(id 284\) holds 'é', which is no token of its own"),
    (_tiny_spm_meta(**{"tokenizer.ggml.pre": "llama-bpe"}), "tokenizer.ggml.pre is 'llama-bpe'"),
    ({**_tiny_spm_meta(), "tokenizer.ggml.tokens": ["a", "b", "a"], "tokenizer.ggml.token_type": [1] * 3,
      "tokenizer.ggml.scores": [0.0] * 3}, "'a' is in the vocabulary twice"),
    ({**_tiny_spm_meta(), "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.token_type": [1] * 2,
      "tokenizer.ggml.scores": [0.0] * 2}, "without the byte tokens <0x00>, <0x01>"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery", "tokenizer.ggml.tokens": ["a"],
      "tokenizer.ggml.merges": []}, r"tokenizer\.ggml\.pre is 'mystery'.*supported: .*llama-bpe"),
])
def test_tokenizer_keys_not_understood(meta: dict, match: str) -> None:
    with pytest.raises(ModelFormatError, match=match):
        Tokenizer.from_gguf_metadata(meta, "tiny.gguf")


# --- byte-level BPE split patterns: Llama 3 ("llama-bpe") and llama.cpp's "default" ---------------

# Llama 3's split regex as its tokenizer.json writes it, and as llama.cpp's llm_tokenizer_bpe spells
# it (LLAMA_VOCAB_PRE_TYPE_LLAMA3: the contractions' cases written out).
LLAMA3_JSON_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_LLAMA_CPP_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>"]


def _byte_level_meta(pre: str, merges: list[str], words: list[str] = (), **keys) -> dict:
    """A byte-level vocabulary: the 256 byte symbols, one token per merge, ``words``, then Llama 3's
    control tokens."""
    tokens = [*_byte_alphabet().values(), *(m.replace(" ", "") for m in merges), *words, *LLAMA3_SPECIAL]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * (len(tokens) - len(LLAMA3_SPECIAL)) + [3] * len(LLAMA3_SPECIAL),
            "tokenizer.ggml.merges": merges, **keys}


def _llama3() -> Tokenizer:
    # "Ġhello" is a token no merge makes: llama.cpp (ignore_merges) takes the word " hello" whole.
    meta = _byte_level_meta("llama-bpe", ["Ġ t", "h e", "Ġt he", "Ġ c", "a t", "Ġc at"], ["Ġhello"],
                            **{"tokenizer.ggml.bos_token_id": 263, "tokenizer.ggml.eos_token_id": 267,
                               "tokenizer.chat_template": LLAMA3_TEMPLATE})
    return Tokenizer.from_gguf_metadata(meta, "tiny-llama3.gguf")


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    """How the pre-tokenizer cuts ``text``, in plain text (the byte alphabet mapped back)."""
    back = {c: b for b, c in _byte_alphabet().items()}
    return [bytes(back[c] for c in p).decode("utf-8") for p, _ in tok._tok.pre_tokenizer.pre_tokenize_str(text)]


SPLIT_TEXTS = [*VARIED, "I'm 12345 years\n\n  old", "THEY'RE it'S we'Ve 1234567 x  \n\t y", "it'ſt naïve 𝔘𝔫𝔦 ٣٤٥٦"]


def test_llama3_split_regex() -> None:
    regex = pytest.importorskip("regex", reason="pip install regex")
    tok = _llama3()
    for text in SPLIT_TEXTS:
        pieces = _pieces(tok, text)
        assert pieces == regex.findall(LLAMA3_LLAMA_CPP_SPLIT, text) and "".join(pieces) == text, text
        if "ſ" not in text:  # the only place the two spellings part: (?i:'s) matches "'ſ" too
            assert pieces == regex.findall(LLAMA3_JSON_SPLIT, text), text
    assert _pieces(tok, "I'm 12345 years\n\n  old") == ["I", "'m", " ", "123", "45", " years", "\n\n", " ", " old"]
    assert regex.findall(LLAMA3_JSON_SPLIT, "it'ſt") == ["it", "'ſ", "t"] and _pieces(tok, "it'ſt") == ["it", "'ſt"]


def test_llama3_tokenizer_and_template() -> None:
    tok = _llama3()
    assert tok.add_bos_token  # llama.cpp's default for llama-bpe, where the file has no add_bos_token
    assert tok.eos_token_ids == (267, 268, 264)  # the file's <|eot_id|>, then <|eom_id|> and <|end_of_text|>
    assert tok.encode(" hello") == [263, 262]  # a word that is a token is that token (ignore_merges)
    assert tok.encode(" the cat") == [263, 258, 261]
    text = tok.apply_chat_template(CHAT[:2])
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nWrite fib in Python.<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode(text)
    assert ids[:2] == [263, 265] and ids.count(263) == 1 and ids.count(267) == 2  # one BOS: the template's
    assert tok.decode(ids[-3:], skip_special_tokens=False) == "<|end_header_id|>\n\n"
    assert tok.decode(ids) == "system\n\nYou are terse.user\n\nWrite fib in Python.assistant\n\n"
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_default_pre_splits_as_llama_cpp() -> None:
    """A byte-level file whose pre-tokenizer is "default" (or unnamed) is split with llama.cpp's
    four patterns in turn: punctuation runs, GPT-2's pattern, digit runs, digits in threes."""
    tok = Tokenizer.from_gguf_metadata(_byte_level_meta("default", []), "tiny.gguf")
    expected = ["Hello", ",", " world", "!!", " ", "123", "45", " ", "$", "x", "+=", "1", " don", "'", "t"]
    assert _pieces(tok, "Hello, world!! 12345 $x+=1 don't") == expected
    meta = _byte_level_meta("default", [])
    del meta["tokenizer.ggml.pre"]
    assert _pieces(Tokenizer.from_gguf_metadata(meta, "tiny.gguf"), "Hello, world!! 12345") == expected[:7]
    assert not tok.add_bos_token  # nothing asks for BOS
