"""The documentation: the mkdocs site builds with --strict (a broken link, a missing anchor or a
page left out of the navigation fails it), its generated pages are filled, the README's relative
links point at files that exist, and the package's PyPI page (pyproject.toml's readme) has no
relative links, which PyPI cannot follow, and quotes the README's examples as they are."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    cli = (site / "cli" / "index.html").read_text()
    assert "usage: quickdraft serve" in cli and "usage: quickdraft bench" in cli  # the hook ran the parsers
    bench = (site / "benchmarks" / "index.html").read_text()
    assert "generated:" not in bench and "speedup over" in bench  # the current tables were generated


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert local, "the README links to the docs"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def _pypi_page() -> str:
    readme = re.search(r'^readme = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)  # tomllib: 3.11+
    return (ROOT / readme.group(1)).read_text()


def test_the_pypi_page_has_no_relative_links():
    text = _pypi_page()
    # inline links and images, then reference definitions ("[name]: target")
    targets = re.findall(r"\]\(\s*<?([^)\s>]*)", text) + re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S*?)>?\s*$", text, re.M)
    relative = [t for t in targets if not re.match(r"(https?:|mailto:|#)", t)]
    assert not relative, f"relative links on the PyPI page: {relative}"


def test_the_pypi_page_quotes_the_readme():
    """Its examples are the README's, word for word (the install lines aside: PyPI installs by name)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", _pypi_page(), re.M | re.S)
    assert blocks
    stale = [b for b in blocks if "pip install" not in b and b not in readme]
    assert not stale, f"examples on the PyPI page that the README does not have: {stale}"


def _parsers(parser):
    import argparse

    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_default_is_shown_in_help():
    from quickdraft.commands.cli import build_parser

    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 8  # every subcommand, train's and bench's included
    for parser in parsers:
        for action in parser._actions:
            if action.option_strings and action.default not in (None, False, "==SUPPRESS==") and action.help != "==SUPPRESS==":
                entry = parser._get_formatter()._format_action(action)  # the flag's lines in --help
                assert "default" in entry.lower(), f"{parser.prog} {action.option_strings[-1]}: --help hides its default"


def test_version_flag(capsys):
    import pytest

    from quickdraft import __version__
    from quickdraft.commands.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"quickdraft {__version__}"
