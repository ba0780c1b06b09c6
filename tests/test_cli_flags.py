"""One command vocabulary: every parser takes the new flag names, the old spellings still work with
one deprecation line naming the new flag, every switch is --flag/--no-flag, and no help text
carries a measurement. Parsers only: nothing runs."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from quickdraft.bench import loadgen, turns
from quickdraft.commands.cli import build_parser
from quickdraft.errors import ConfigError
from quickdraft.server.cli import args_from_dict, serve_parser

# (command words, new flag and value, dest, parsed value, old spelling)
RENAMED = [
    (["bench"], ["--num-prompts", "humaneval=4"], "num_prompts", "humaneval=4", "--limit"),
    (["bench"], ["--result-dir", "out"], "result_dir", "out", "--out"),
    (["bench"], ["--num-speculative-tokens-list", "2,4"], "num_speculative_tokens", "2,4", "--num-speculative-tokens"),
    (["advise", "p.jsonl"], ["--max-num-speculative-tokens", "6"], "num_speculative_tokens", 6,
     "--num-speculative-tokens"),
    (["bench", "accuracy"], ["--num-prompts", "3"], "num_prompts", 3, "--limit"),
    (["bench", "accuracy"], ["--num-greedy-prompts", "2"], "num_greedy_prompts", 2, "--greedy-limit"),
    (["bench", "accuracy"], ["--result-dir", "out"], "result_dir", "out", "--out"),
    (["check"], ["--num-seeds", "8"], "num_seeds", 8, "--seeds"),
    (["check"], ["--num-sampled-prompts", "3"], "num_sampled_prompts", 3, "--sampled-prompts"),
    (["profile"], ["--batch-size", "1,2"], "batch_size", "1,2", "--batch-sizes"),
    (["advise", "p.jsonl"], ["--batch-size", "1,2"], "batch_size", "1,2", "--batch-sizes"),
    (["advise", "p.jsonl"], ["--num-prompts", "5"], "num_prompts", 5, "--limit"),
    (["advise", "p.jsonl"], ["--result-dir", "out"], "result_dir", "out", "--out"),
    (["train", "data"], ["--num-label-tokens", "1000"], "num_label_tokens", 1000, "--max-tokens"),
    (["train", "eagle3"], ["--num-label-tokens", "1000"], "num_label_tokens", 1000, "--max-tokens"),
    (["train", "eagle3"], ["--output-dir", "head"], "output_dir", "head", "--out"),
    (["train", "medusa"], ["--output-dir", "head"], "output_dir", "head", "--out"),
    (["train", "draft"], ["--draft-model", "d.gguf"], "draft_model", "d.gguf", "--draft"),
    (["train", "draft"], ["--output-dir", "tuned"], "output_dir", "tuned", "--out"),
    (["train", "generate"], ["--output-file", "a.jsonl"], "output_file", "a.jsonl", "--out"),
    (["train", "generate"], ["--batch-size", "4"], "batch_size", 4, "--batch"),
]


@pytest.mark.parametrize("words, new, dest, value, old", RENAMED)
def test_new_names_parse_and_old_ones_map_to_them_with_one_line(capsys, words, new, dest, value, old):
    assert getattr(build_parser().parse_args([*words, *new]), dest) == value
    assert capsys.readouterr().err == ""
    args = build_parser().parse_args([*words, old, new[1]])
    assert getattr(args, dest) == value
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and old in err[0] and new[0] in err[0] and "deprecated" in err[0]


@pytest.mark.parametrize("make, argv, dest, value, old", [
    (loadgen.parser, ["--speculative-config", "none"], "speculative_config", ["none"], "--config"),
    (loadgen.parser, ["--result-dir", "out"], "result_dir", "out", "--out"),
    (turns.parser, ["--num-prompts", "4"], "num_prompts", 4, "--limit"),
    (turns.parser, ["--result-dir", "out"], "result_dir", "out", "--out"),
])
def test_the_load_generators_speak_the_same_names(capsys, make, argv, dest, value, old):
    assert getattr(make().parse_args(argv), dest) == value
    assert getattr(make().parse_args([old, argv[1]]), dest) == value
    assert f"use {argv[0]}" in capsys.readouterr().err


def test_the_old_true_false_form_of_a_switch(capsys):
    parse = lambda *argv: build_parser().parse_args(["bench", *argv]).adaptive  # noqa: E731
    assert (parse(), parse("--adaptive"), parse("--no-adaptive")) == (None, True, False)
    assert capsys.readouterr().err == ""
    assert parse("--adaptive", "false") is False and "use --no-adaptive" in capsys.readouterr().err
    assert parse("--adaptive", "true") is True and "use --adaptive" in capsys.readouterr().err
    assert parse("--adaptive", "true,false") == (True, False)
    with pytest.raises(SystemExit):
        parse("--no-adaptive", "true")


def test_switches_have_a_no_form_everywhere(capsys):
    parse = lambda *argv: build_parser().parse_args(list(argv))  # noqa: E731
    assert parse("bench", "--no-progress").progress is False and parse("bench").progress is True
    assert parse("bench", "accuracy", "--no-llama-cpp").llama_cpp is False
    assert parse("serve", "--no-access-log").access_log is False and parse("serve").access_log is True
    assert parse("generate", "hi", "--json", "--no-json").json is False
    assert capsys.readouterr().err == ""


def _parsers():
    def walk(p):
        yield p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in dict.fromkeys(a.choices.values()):
                    yield from walk(sub)

    yield from walk(build_parser())
    yield serve_parser()
    yield loadgen.parser()
    yield turns.parser()


def test_every_switch_is_a_flag_and_no_flag_pair():
    for p in _parsers():
        for a in p._actions:
            if a.option_strings and a.nargs == 0 and not isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
                assert isinstance(a, argparse.BooleanOptionalAction), f"{p.prog} {a.option_strings}"


# "2.2x faster", "about 5 min", "120 ms", "35 tok/s": figures belong to the benchmark pages
MEASUREMENT = re.compile(r"\d(\.\d+)?x\b|\d+(\.\d+)? ?(min|minutes|ms|s)\b(?! per)|tok/s|faster here|measured \d")


def test_help_texts_carry_no_measurements():
    for p in _parsers():
        text = p.format_help()
        assert not MEASUREMENT.search(text), f"{p.prog}: {MEASUREMENT.search(text).group(0)!r}"


def test_every_help_shows_the_new_names_only():
    for p in _parsers():
        text = p.format_help()
        for old in ("--limit", "--out ", "--seeds", "--batch-sizes", "--greedy-limit", "--sampled-prompts",
                    "--draft ", "--config "):
            assert old not in text, f"{p.prog} shows {old}"


def test_draft_model_and_k_are_shorthands_for_the_speculative_config():
    from quickdraft.arguments import resolve_model_args

    def spec(*argv):
        args = resolve_model_args(build_parser().parse_args(["serve", *argv]))
        return json.loads(args.speculative_config) if args.speculative_config else None

    assert spec() is None
    assert spec("--draft-model", "d.gguf") == {"method": "draft_model", "model": "d.gguf"}
    assert spec("--draft-model", "d.gguf", "--num-speculative-tokens", "3") == {
        "method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 3}
    assert spec("--speculative-config", '{"method": "ngram"}', "--num-speculative-tokens", "2") == {
        "method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="method"):
        spec("--num-speculative-tokens", "2")
    with pytest.raises(ConfigError, match="differ"):
        spec("--speculative-config", '{"method": "draft_model", "model": "a"}', "--draft-model", "b")
    with pytest.raises(ConfigError, match="draft_model"):
        spec("--speculative-config", '{"method": "ngram"}', "--draft-model", "b")
    assert json.loads(args_from_dict({"draft_model": "d.gguf"}, "a test").speculative_config)["model"] == "d.gguf"


def test_a_replicas_dict_sets_switches_both_ways(capsys):
    assert args_from_dict({"access_log": False}, "a test").access_log is False
    assert args_from_dict({"no_access_log": "true"}, "a test").access_log is False
    assert args_from_dict({"no_access_log": False}, "a test").access_log is True
    assert args_from_dict({"enable_prefix_caching": "false"}, "a test").enable_prefix_caching is False
    assert args_from_dict({"ray": False}, "a test").ray is False
    assert capsys.readouterr().err == ""
