"""Tokenizer: the ids real models expect, agreement with transformers' GGUF tokenizer, chat
templates rendered in a sandbox, and the JSON round trip the conversion cache relies on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from jinja2.exceptions import SecurityError

from quickdraft.errors import QuickdraftError
from quickdraft.models.tokenizer import Tokenizer

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
