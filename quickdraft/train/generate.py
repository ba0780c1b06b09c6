"""Self-distillation texts: the target's own answers to prompts, generated batched by our engine
(``quickdraft train generate``), then labelled like any text (``quickdraft train data --texts``).

A head drafts the target's own continuations when it serves, so text the target wrote is the
closest match to what it will be asked (EAGLE's Table 6: 3.75 tokens a pass on generated answers
against 3.62 on fixed data). It costs decode speed where labelling existing text costs prefill
speed; both are measured in docs/features/trained-heads.md.

The default prompts come from the same place as the default text, never from a bench set: each
function with a docstring in the installed packages' sources (train/data.py's corpus, benchmark
packages and ``tests`` folders excluded) becomes a completion prompt, its ``def`` line and
docstring as HumanEval's prompts are, or, every other one, a chat request to implement it; each
distribution's one-line summary becomes a chat request to explain the package. A user's JSONL
(``--prompts``: ``"prompt"`` raw, or ``"messages"`` a chat) replaces them.

Each answer is written as one JSONL line ``{"text": prompt + answer}`` (the chat rendered through
the target's template, special tokens as text, which the tokenizer reads back whole), appended as
it is made, so a rerun resumes after the last line written.
"""

from __future__ import annotations

import ast
import json
import random
import re
import sys
from pathlib import Path
from typing import Iterator

from quickdraft.errors import ConfigError

MAX_PROMPT_CHARS = 3000


def _function_prompts(source: str) -> Iterator[str]:
    """``def`` line(s) and docstring of each documented function in ``source``, as written."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        if len(node.body) < 2 or len(doc.value.value.strip()) < 20:  # a real body to write, a real description
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        text = "".join(lines[start : doc.end_lineno])
        indent = len(text) - len(text.lstrip(" "))
        text = "".join(line[indent:] if line[:indent].isspace() else line for line in text.splitlines(keepends=True))
        if len(text) <= MAX_PROMPT_CHARS:
            yield text if text.endswith("\n") else text + "\n"


def _summary(metadata: str) -> tuple[str, str] | None:
    name = summary = None
    for line in metadata.splitlines():
        if line.startswith("Name: "):
            name = line[6:].strip()
        elif line.startswith("Summary: "):
            summary = line[9:].strip()
        elif not line.strip():
            break
    if not name or not summary or len(summary) < 25 or re.search(r"(part|chunk)[-_]?\d", name.lower()):
        return None  # no description to explain, or a piece of a split package (model weights)
    return name, summary


def default_prompts(limit: int, seed: int = 0) -> list[dict]:
    """Up to ``limit`` prompts from the installed packages (module docstring), in a fixed order."""
    from quickdraft.train.data import default_files

    rng = random.Random(seed)
    code, chat = [], []
    for f in default_files():
        try:
            text = f.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if f.name == "METADATA":
            got = _summary(text)
            if got is not None:
                chat.append({"messages": [{"role": "user", "content": f"What is the Python package {got[0]} for? Its "
                                                                      f"summary says: {got[1]}. Explain it briefly, "
                                                                      f"with a short example."}]})
            continue
        found = list(_function_prompts(text))
        if found:
            code.append(rng.choice(found))  # one function a file: many packages, not one file's methods
        if len(code) >= limit and len(chat) >= limit // 4:
            break
    prompts = []
    for i, fn in enumerate(code):
        if i % 2 == 0:
            prompts.append({"prompt": fn})
        else:
            prompts.append({"messages": [{"role": "user", "content": f"Implement this Python function:\n\n"
                                                                     f"```python\n{fn}```"}]})
        if i % 4 == 3 and chat:
            prompts.append(chat.pop())
    return prompts[:limit]


def read_prompts(path: str | Path) -> list[dict]:
    """A user's prompts: JSONL, one object a line with ``"prompt"`` (raw text) or ``"messages"``."""
    from quickdraft.train.data import jsonl_lines

    out = []
    for n, doc in jsonl_lines(path, "prompts"):
        if not (isinstance(doc, dict) and (isinstance(doc.get("prompt"), str) or isinstance(doc.get("messages"), list))):
            raise ConfigError(f'--prompts {path}: line {n} has no "prompt" (text) or "messages" (a chat)', "prompts")
        out.append(doc)
    return out


def generate(llm, prompts: list[dict], out_file: str | Path, max_tokens: int = 256, batch: int = 8,
             progress: bool = True) -> int:
    """Answer each prompt greedily with ``llm`` (an ``LLM``), ``batch`` at a time, appending
    ``{"text": prompt + answer}`` lines to ``out_file``; the prompts already answered there (its
    line count) are skipped. Returns the tokens generated."""
    from tqdm import tqdm

    from quickdraft.sampling import SamplingParams

    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = sum(1 for _ in out.open(encoding="utf-8")) if out.is_file() else 0
    tok = llm.tokenizer
    texts = [p["prompt"] if "prompt" in p else tok.apply_chat_template(p["messages"], add_generation_prompt=True)
             for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    bar = tqdm(total=len(texts), initial=min(done, len(texts)), desc="generating answers", unit="prompt",
               file=sys.stderr, disable=not progress, mininterval=1.0)
    made = 0
    with out.open("a", encoding="utf-8") as f:
        for a in range(done, len(texts), batch):
            chunk = texts[a : a + batch]
            for text, o in zip(chunk, llm.generate([tok.encode(t) for t in chunk], [params] * len(chunk))):
                f.write(json.dumps({"text": text + tok.decode(o.token_ids, skip_special_tokens=False)}) + "\n")
                made += len(o.token_ids)
            f.flush()
            bar.update(len(chunk))
    bar.close()
    return made
