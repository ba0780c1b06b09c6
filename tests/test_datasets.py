"""The prompt-set readers on the real files of the installed packages, and a user's JSONL."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from quickdraft.errors import ConfigError
from quickdraft.evaluation import datasets


def test_humaneval_reads_all_164_completion_prompts():
    rows = datasets.humaneval()
    assert len(rows) == 164
    assert rows[0].id == "HumanEval/0" and rows[-1].id == "HumanEval/163"
    assert all(r.category == "coding" and r.dataset == "humaneval" and r.num_turns == 1 for r in rows)
    assert "def has_close_elements" in rows[0].prompt
    assert datasets.humaneval(limit=3) == rows[:3]


def test_mtbench_reads_80_two_turn_questions_in_8_categories():
    rows = datasets.mtbench()
    assert len(rows) == 80
    counts = Counter(r.category for r in rows)
    assert counts == {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                      "humanities")}
    assert all(r.num_turns == 2 and r.prompt is None and len(r.turns) == 2 for r in rows)
    assert rows[0].id == "81" and rows[0].turns[0].startswith("Compose an engaging travel blog post")


def test_limit_is_round_robin_over_categories_and_categories_filter():
    eight = datasets.load("mtbench", limit=8)
    assert len({r.category for r in eight}) == 8
    math_only = datasets.load("mtbench", limit=3, categories=["math"])
    assert [r.category for r in math_only] == ["math"] * 3
    assert len(datasets.load("humaneval", limit=0)) == 164  # 0 = all


def test_user_jsonl_prompt_messages_and_turns(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        {"prompt": "def add(a, b):", "category": "code"},
        {"messages": [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Hi"}]},
        {"id": "t", "turns": ["First?", "Second?"]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    rows = datasets.load(str(path))
    assert [r.category for r in rows] == ["code", "default", "default"]
    assert rows[0].prompt == "def add(a, b):" and rows[0].id == "1"
    assert rows[1].messages[0]["role"] == "system" and rows[1].num_turns == 1
    assert rows[2].id == "t" and rows[2].num_turns == 2
    assert all(r.dataset == "mine" for r in rows)


@pytest.mark.parametrize("line", ['{"text": "no prompt key"}', "not json", '{"messages": [{"role": "user"}]}', "[1]"])
def test_user_jsonl_bad_lines_name_the_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        datasets.user_jsonl(path)


def test_unknown_dataset_is_a_clear_error():
    with pytest.raises(ConfigError, match="humaneval, mtbench"):
        datasets.load("nonesuch")


class ChatEcho:
    """A tokenizer stand-in whose chat template shows the messages it was given."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return json.dumps(messages)


def test_render_second_turn_carries_the_first_answer():
    p = datasets.Prompt("1", "math", turns=["What is 2+2?", "And times 3?"])
    first = json.loads(datasets.render(p, ChatEcho(), []))
    assert first == [{"role": "user", "content": "What is 2+2?"}]
    second = json.loads(datasets.render(p, ChatEcho(), ["4"]))
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] == "4" and second[2]["content"] == "And times 3?"
    raw = datasets.Prompt("HumanEval/0", "coding", prompt="def f():")
    assert datasets.render(raw, ChatEcho(), []) == "def f():"


def test_render_through_a_real_chat_template(smollm2_tokenizer):
    p = datasets.mtbench(limit=1)[0]
    text = datasets.render(p, smollm2_tokenizer, ["MY FIRST ANSWER"])
    assert text.index(p.turns[0]) < text.index("MY FIRST ANSWER") < text.index(p.turns[1])
    assert text.rstrip().endswith("assistant")
