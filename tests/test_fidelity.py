"""``quickdraft fidelity``: its arithmetic on distributions worked out by hand, its chunks as
llama-perplexity cuts them, and end to end on SmolLM2: the float32 dequantized path against itself
is exactly zero, the default path (Q4_1 blocks, bfloat16) is close but not zero, and llama.cpp, where
llama-cpp-python is installed, is measured on the same chunks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from quickdraft.commands.cli import main
from quickdraft.commands.fidelity import Tally, chunks, scored_logprobs

TEXT = " ".join(f"Question {i}: what is {i} times {i + 3}, and why does the answer end in {(i * (i + 3)) % 10}?"
                for i in range(40))


def test_kl_perplexity_and_agreement_by_hand() -> None:
    ref = torch.tensor([[0.5, 0.5], [0.9, 0.1]]).log()
    mine = torch.tensor([[0.25, 0.75], [0.9, 0.1]]).log()
    t = Tally()
    t.add(ref, mine, torch.tensor([1, 0]))
    s = t.summary()
    assert s["kl_mean"] == pytest.approx(0.5 * math.log(4 / 3) / 2, rel=1e-6)  # row 0: 0.5 ln 2 + 0.5 ln 2/3
    assert s["kl_max"] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert s["perplexity"] == pytest.approx(math.exp(-(math.log(0.75) + math.log(0.9)) / 2), rel=1e-6)
    assert s["same_top_token"] == 0.5  # row 0: the reference's tie goes to token 0, ours is token 1
    assert s["max_abs_dlogp"] == pytest.approx(math.log(0.75 / 0.5), rel=1e-6)


def test_chunks_as_llama_perplexity_cuts_them() -> None:
    ids = list(range(10, 30))
    assert chunks(ids, 8, 10, bos=1) == [[1, *range(11, 18)], [1, *range(19, 26)]]  # whole chunks only
    assert chunks(ids, 8, 1, bos=None) == [list(range(10, 18))]
    logits = torch.randn(8, 5)
    lp = scored_logprobs(logits, list(range(8)))
    assert lp.shape == (3, 5) and torch.allclose(lp, torch.log_softmax(logits[4:7], -1))  # predicting tokens 5..7


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


def run(capsys, *argv: str) -> tuple[int, dict | str]:
    code = main(["fidelity", "--model", "smollm2-135m-instruct", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 and "--json" in argv else err or out)


@pytest.mark.slow
def test_the_float32_path_is_the_reference_and_the_default_is_close(capsys, smollm2_path, text_file) -> None:
    code, same = run(capsys, "--text", text_file, "--ctx", "64", "--chunks", "3", "--dtype", "float32",
                     "--quantization", "none", "--no-llama-cpp", "--num-greedy-prompts", "2", "--greedy-tokens", "24",
                     "--json")
    assert code == 0 and same["chunks"] == 3 and same["reference"]["tokens"] == 3 * 31
    s = same["paths"]["quickdraft"]
    assert s["kl_max"] == 0 and s["same_top_token"] == 1 and s["max_abs_dlogp"] == 0
    assert s["perplexity"] == pytest.approx(same["reference"]["perplexity"], rel=1e-12)
    assert same["llama_cpp"] == {"skipped": "--no-llama-cpp"}
    assert [g["float32"] for g in same["greedy"]] == [{"first_difference": None}] * 2 and "llama.cpp" not in same["greedy"][0]

    code, default = run(capsys, "--text", text_file, "--ctx", "64", "--chunks", "3", "--greedy-tokens", "48", "--json")
    assert code == 0
    d = default["paths"]["quickdraft"]
    assert default["reference"]["perplexity"] == pytest.approx(same["reference"]["perplexity"], rel=1e-12)
    assert 0 < d["kl_mean"] < 0.05 and d["same_top_token"] > 0.8
    assert d["perplexity"] == pytest.approx(default["reference"]["perplexity"], rel=0.05)
    assert len(default["greedy"]) == 5
    for g in default["greedy"]:  # the built-in prompts: where bfloat16 on Q4_1 blocks leaves float32, if it does
        at = g["float32"]["first_difference"]
        assert at is None or (0 <= at < 48 and g["float32"]["quickdraft_token"] != g["float32"]["their_token"]
                              and g["float32"]["margin_float32"] >= 0)
    if "llama.cpp" in default["paths"]:  # llama-cpp-python installed: the peer on the same chunks
        p = default["paths"]["llama.cpp"]
        assert p["tokens"] == d["tokens"] and 0 < p["kl_mean"] < 0.05 and p["same_top_token"] > 0.8


@pytest.mark.parametrize("argv, needle", [
    (["--ctx", "7"], "--ctx must be an even number"),
    (["--chunks", "0"], "--chunks must be at least 1"),
    (["--greedy-tokens", "0"], "--greedy-tokens must be at least 1"),
    (["--ctx", "4096"], "fewer than one chunk"),
    (["--text", "/no/such/file.txt"], "cannot be read"),
])
def test_bad_input_exits_2_saying_what(capsys, smollm2_path, text_file, argv, needle) -> None:
    argv = argv if "--text" in argv else ["--text", text_file, *argv]
    code, err = run(capsys, *argv, "--no-llama-cpp")
    assert code == 2 and needle in err
