"""quickdraft/structured.py on SmolLM2's tokenizer: the matcher's masks follow the drafts and leave
its state as it was, drafts are cut at the first rejected token, forced tokens are the grammar's only
continuation, and specs that do not compile are StructuredOutputErrors."""

from __future__ import annotations

import pytest
import torch

from quickdraft.server.tools import parse_tool_calls, tool_spec
from quickdraft.structured import GrammarCompiler, StructuredOutputError, StructuredSpec, apply_masks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size)


def test_masks_follow_the_drafts_and_roll_back(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    m = compiler.matcher(StructuredSpec.json_schema(SCHEMA))
    text = tok.encode('{"name": "Ada", "age": 36}')
    assert m.allowed_prefix(text) == len(text)
    assert m.allowed_prefix(tok.encode('{"name": 3')) < len(tok.encode('{"name": 3'))  # a number where a string goes
    before = m.masks([])
    masks = m.masks(text[:5])  # [6, V]
    assert torch.equal(masks[0], before[0]) and torch.equal(m.masks([])[0], before[0])  # rolled back
    for j in range(6):
        assert bool(masks[j, text[j]]) if j < len(text) else True
    assert not masks[0, tok.encode("x")[0]]  # nothing but the object may start
    forced = m.forced(16)
    assert tok.decode(forced).startswith('{"name":')  # the key and its punctuation are forced
    for t in text:
        assert m.advance(t)
    assert m.terminated and m.forced(4) == []


def test_a_draft_walks_the_grammar_and_steps_back(compiler, smollm2_tokenizer):
    """``mask`` is the state's row of ``masks``; ``advance`` then ``rollback`` leaves the state as
    it was (what a draft model does along its own tokens)."""
    tok = smollm2_tokenizer
    m = compiler.matcher(StructuredSpec.json_schema(SCHEMA))
    text = tok.encode('{"name": "Ada", "age": 36}')
    rows = m.masks(text[:4])  # [5, V]
    for j in range(4):
        assert torch.equal(m.mask(), rows[j])
        assert m.advance(text[j])
    assert torch.equal(m.mask(), rows[4])
    m.rollback(4)
    assert torch.equal(m.mask(), rows[0]) and m.allowed_prefix(text) == len(text)
    for t in text:
        m.advance(t)
    assert m.terminated and not m.mask().any()  # stopped: the draft proposes nothing more


def test_a_stopped_grammar_keeps_the_end_of_sequence():
    rows = torch.zeros(2, 5)
    apply_masks(rows, torch.tensor([[True, False, False, False, False], [False] * 5]), [4])
    assert rows[0].tolist() == [0.0] + [float("-inf")] * 4
    assert rows[1].tolist() == [float("-inf")] * 4 + [0.0]


@pytest.mark.parametrize("spec", [StructuredSpec("regex", "(ab"), StructuredSpec("grammar", "root ::= ("),
                                  StructuredSpec.json_schema({"type": "nonsense"})])
def test_specs_that_do_not_compile(compiler, spec):
    with pytest.raises(StructuredOutputError, match="does not compile"):
        compiler.compile(spec)


def test_choice_and_gbnf(compiler, smollm2_tokenizer):
    m = compiler.matcher(StructuredSpec.choice(["yes", "no"]))
    assert m.allowed_prefix(smollm2_tokenizer.encode("no")) == 1 and m.allowed_prefix(smollm2_tokenizer.encode("maybe")) == 0
    m = compiler.matcher(StructuredSpec("grammar", 'root ::= "a" [0-9]+'))
    assert m.allowed_prefix(smollm2_tokenizer.encode("a12")) == len(smollm2_tokenizer.encode("a12"))


def test_tool_call_grammar_and_parsing(compiler, smollm2_tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    m = compiler.matcher(tool_spec(tools, {"type": "function", "function": {"name": "add"}}, smollm2_tokenizer))
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    ids = smollm2_tokenizer.encode(call)
    assert m.allowed_prefix(ids) == len(ids)
    content, calls = parse_tool_calls("Sure. " + call)
    assert content == "Sure." and calls[0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert parse_tool_calls("no call here") == ("no call here", [])
