"""mkdocs hook: the pages made at build time from the code and the committed results.

- ``cli.md``: every subcommand's ``--help``, from the argparse parsers themselves
  (``quickdraft.commands.cli.build_parser``), so the reference cannot drift from the flags.
- ``benchmarks/index.md``: one current table per CPU class, from the ``results.json`` of the runs
  named in ``CURRENT`` (committed under ``benchmarks/archive``).
- ``benchmarks/archive/index.md``: one line per archived run, from each folder's README header.

A page marks where generated text goes with ``<!-- generated: NAME -->``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent
ARCHIVE = DOCS / "benchmarks" / "archive"

# CPU class -> the archived bench run whose results.json is that class's current table.
CURRENT = {
    "x86-64 with AVX-512 VNNI, no AMX (AMD EPYC, Zen 4)": "llama-server-draft-amd",
    "x86-64 with AVX-512 VNNI and AMX (Intel Xeon)": "gguf-vs-llama-cpp-intel-amx",
}


# -- the CLI reference ---------------------------------------------------------------------------

def _subparsers(parser: argparse.ArgumentParser, prog: str = "quickdraft"):
    """(its command words, parser) for every subcommand under ``parser``, depth first (the words,
    not argparse's ``prog``: under a parser with a usage of its own that is the whole usage)."""
    for action in parser._actions:  # argparse keeps subcommands in a private action
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # aliases map to one parser
                    continue
                seen.add(id(sub))
                yield f"{prog} {name}", sub
                yield from _subparsers(sub, f"{prog} {name}")


def cli_reference() -> str:
    from quickdraft.commands.cli import build_parser

    parser = build_parser()
    parts = [f"## `quickdraft`\n\n```text\n{parser.format_help()}```\n"]
    for prog, sub in _subparsers(parser):
        parts.append(f"## `{prog}`\n\n```text\n{sub.format_help()}```\n")
    return "\n".join(parts)


# -- benchmarks ----------------------------------------------------------------------------------

def _row(summary: list[dict], variant: str, dataset: str) -> dict | None:
    return next((s for s in summary if s["variant"] == variant and s["dataset"] == dataset
                 and s["category"] == "all"), None)


def _cell(row: dict | None, key: str, fmt: str) -> str:
    if row is None or row.get(key) is None:
        return "-"
    return fmt.format(row[key])


def current_table(folder: str) -> str:
    result = json.loads((ARCHIVE / folder / "results.json").read_text())
    summary = result["summary"]
    variants = list(dict.fromkeys(s["variant"] for s in summary))
    lines = ["| variant | HumanEval tok/s | MT-Bench tok/s | all: tok/s | all: tokens a target pass "
             "| all: speedup over `none` | identical to `none` |", "|---|---|---|---|---|---|---|"]
    for v in variants:
        he, mt, al = (_row(summary, v, d) for d in ("humaneval", "mtbench", "all"))
        same = al["lossless"].get("fraction_identical") if al else None
        lines.append(f"| `{v}` | {_cell(he, 'tokens_per_second_median', '{:.2f}')} "
                     f"| {_cell(mt, 'tokens_per_second_median', '{:.2f}')} "
                     f"| {_cell(al, 'tokens_per_second_median', '{:.2f}')} "
                     f"| {_cell(al, 'mean_accepted_length', '{:.2f}')} "
                     f"| {al['speedup']['median']:.2f}x | {'-' if same is None else f'{same:.0%}'} |")
    peers = (result.get("peers") or {}).get("summary", [])
    for peer in peers:
        if peer["dataset"] == "all":
            lines.append(f"| {peer['name']} (peer) | | | {peer['tokens_per_second_median']:.2f} | | | "
                         f"{peer['fraction_identical_to_quickdraft_none']:.0%} |")
    lines += _llama_cpp_rows(peers)
    machine = result["machine"]
    head = (f"Run of {result['started_at'][:10]} on {machine['cpu']} ({machine['cpu_count']} cores, "
            f"{machine['torch_threads']} torch threads), torch {result['versions']['torch']}; "
            f"[the run's folder](archive/{folder}/README.md).\n\n"
            f"```bash\n{result['command']}\n```\n")
    return head + "\n" + "\n".join(lines) + "\n"


def _llama_cpp_rows(peers: list[dict]) -> list[str]:
    """"llama.cpp plain" and "llama.cpp best" (the fastest plain, and the fastest of all, of the
    llama.cpp peers' methods) on each data set, each cell naming the method where it is not the
    one of the row's label (the one on all the requests)."""
    from quickdraft.bench.peers import llama_cpp_best

    by_set = {b["dataset"]: b for b in llama_cpp_best(peers)}
    if not by_set:
        return []
    lines = []
    for kind in ("plain", "best"):
        label = (by_set.get("all") or next(iter(by_set.values())))[kind]
        cells = []
        for dataset in ("humaneval", "mtbench", "all"):
            row = (by_set.get(dataset) or {}).get(kind)
            if row is None or row.get("tokens_per_second_median") is None:
                cells.append("-")
                continue
            named = "" if label is not None and row["name"] == label["name"] else f" ({row['name']})"
            cells.append(f"{row['tokens_per_second_median']:.2f}{named}")
        same = (by_set.get("all") or {}).get(kind) or {}
        ident = same.get("fraction_identical_to_quickdraft_none")
        lines.append(f"| llama.cpp {kind}: {label['name'] if label else '-'} | {cells[0]} | {cells[1]} | {cells[2]} "
                     f"| | | {'-' if ident is None else f'{ident:.0%}'} |")
    return lines


def current_tables() -> str:
    return "\n".join(f"## {cpu}\n\n{current_table(folder)}" for cpu, folder in CURRENT.items())


def archive_index() -> str:
    rows = ["| run | date | machine |", "|---|---|---|"]
    for readme in sorted(ARCHIVE.glob("*/README.md")):
        text = readme.read_text()
        title = text.splitlines()[0].lstrip("# ").strip()
        date = re.search(r"\*\*Date:\*\* ([0-9-]+(?: to [0-9-]+)?)", text)
        machine = re.search(r"\*\*Machine:\*\* ([^\n(;,]+)", text)
        rows.append(f"| [{title}]({readme.parent.name}/README.md) | {date.group(1) if date else '-'} "
                    f"| {machine.group(1).strip() if machine else '-'} |")
    return "\n".join(rows) + "\n"


GENERATORS = {"cli": cli_reference, "current-benchmarks": current_tables, "archive-index": archive_index}


def on_page_markdown(markdown: str, page, config, files) -> str:
    def fill(m: re.Match) -> str:
        return GENERATORS[m.group(1)]()
    return re.sub(r"<!-- generated: ([a-z-]+) -->", fill, markdown)
