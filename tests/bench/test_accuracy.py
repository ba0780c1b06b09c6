"""``quickdraft bench accuracy``'s arithmetic, on hand-built logits and tiny random models: the
same path twice agrees at every position with zero difference, a perturbed one does not; GGUF
blocks (Q8_0, int8 activations) against their own dequantized weights agree on most positions;
whole-output agreement; llama.cpp's absence is a skip, not an error."""

from __future__ import annotations

import gguf
import gguf.quants
import pytest
import torch

from quickdraft.bench import accuracy, peers
from quickdraft.models.decoder import Decoder
from quickdraft.models.ggml import BlockWeight
from quickdraft.models.tiny import random_weights, tiny_config

CONFIG = tiny_config("qwen2", vocab_size=96, hidden_size=64, num_layers=2)
IDS = [(7 * i + 3) % 96 for i in range(40)]


def test_identical_logits_agree_with_zero_difference():
    ref = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    s = accuracy.summarize_positions(accuracy.compare_logits(ref, ref.clone()))
    assert s["positions"] == 6 and s["top1_agreement"] == 1.0 and s["top1_disagreements"] == 0
    assert s["max_abs_logit_diff"] == 0.0 and s["mean_abs_logit_diff"] == 0.0
    assert s["kl_mean"] == pytest.approx(0.0, abs=1e-7) and s["ref_margin_at_disagreements_max"] is None


def test_perturbed_logits_by_hand():
    ref = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    test = ref + torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.5]])  # row 2's argmax moves from 1 to 2
    m = accuracy.compare_logits(ref, test)
    assert m["max_abs"].tolist() == [0.0, 1.5] and m["ref_margin"].tolist() == [2.0, 1.0]
    assert m["ref_top"].tolist() == [3.0, 2.0]
    assert m["kl"][0].item() == pytest.approx(0.0, abs=1e-7) and m["kl"][1].item() > 0.1
    s = accuracy.summarize_positions(m, next_ids=torch.tensor([0, 2]))
    assert s["top1_agreement"] == 0.5 and s["top1_disagreements"] == 1
    assert s["max_abs_logit_diff"] == 1.5 and s["max_abs_logit_diff_mean"] == 0.75
    assert s["mean_abs_logit_diff"] == pytest.approx(0.25)  # (0 + 1.5 / 3) / 2
    assert s["ref_margin_at_disagreements_max"] == 1.0
    assert s["next_token_accuracy_ref"] == 0.5 and s["next_token_accuracy_test"] == 1.0
    # -1: no next token there (a sequence's last position), left out of next-token accuracy
    assert accuracy.summarize_positions(m, torch.tensor([0, -1]))["next_token_accuracy_test"] == 1.0


def _decoder(seed: int = 1, noise: float = 0.0) -> Decoder:
    w = random_weights(CONFIG, seed=seed, scale=2.0)
    g = torch.Generator().manual_seed(99)
    if noise:
        w = {n: t + noise * torch.randn(t.shape, generator=g) if n.endswith("proj.weight") else t for n, t in w.items()}
    return Decoder(CONFIG, w)


@pytest.mark.parametrize("chunk", [7, 128])
def test_same_decoder_twice_agrees_everywhere(chunk):
    d = _decoder()
    s = accuracy.summarize_positions(accuracy.teacher_forced(d, _decoder(), IDS, chunk))
    assert s["positions"] == len(IDS) and s["top1_agreement"] == 1.0
    assert s["max_abs_logit_diff"] == 0.0 and s["kl_max"] == pytest.approx(0.0, abs=1e-6)


def test_chunks_are_the_one_pass_positions():
    d = _decoder()
    whole, chunked = accuracy.teacher_forced(d, d, IDS, 128), accuracy.teacher_forced(d, d, IDS, 7)
    assert torch.equal(whole["top1_ref"], chunked["top1_ref"])


def test_a_perturbed_decoder_differs():
    m = accuracy.teacher_forced(_decoder(), _decoder(noise=0.3), IDS, 16)
    s = accuracy.summarize_positions(m)
    assert s["top1_agreement"] < 1.0 and s["max_abs_logit_diff"] > 0.1 and s["kl_mean"] > 0.0
    assert s["max_abs_logit_diff"] >= s["max_abs_logit_diff_percentiles"]["p99"] >= s["max_abs_logit_diff_percentiles"]["p50"]


def _as_q8_0(w: torch.Tensor) -> BlockWeight:
    raw = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    return BlockWeight.from_gguf("Q8_0", raw, tuple(w.shape))


def test_blocks_against_their_dequantized_weights():
    """The real pair the command measures, in miniature: Q8_0 projections (kernel or fallback)
    against the same values dequantized to float32."""
    w = random_weights(CONFIG, seed=3, scale=2.0)
    blocks = {n: _as_q8_0(t) if n.endswith("proj.weight") else t for n, t in w.items()}
    dense = {n: t.dequantize(torch.float32) if isinstance(t, BlockWeight) else t for n, t in blocks.items()}
    s = accuracy.summarize_positions(accuracy.teacher_forced(Decoder(CONFIG, dense), Decoder(CONFIG, blocks), IDS, 16))
    assert s["top1_agreement"] >= 0.9, s
    # this tiny model's logits are large (top logit ~40): its differences are read against that
    assert s["max_abs_logit_diff"] < 0.1 * s["ref_top_logit_mean"] and s["kl_mean"] < 0.05, s


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(ch) % 96 for ch in text]


def test_solution_positions_are_those_predicting_solution_tokens():
    problems = [{"task_id": "t/0", "prompt": "def f(x):\n", "canonical_solution": "    return x\n"},
                {"task_id": "t/1", "prompt": "ab", "canonical_solution": "cde"}]
    d = _decoder()
    r = accuracy.run_teacher_forced(d, _decoder(noise=0.3), CharTokenizer(), problems, chunk=4, progress=False)
    assert [p["num_tokens"] for p in r["problems"]] == [23, 5] and r["problems"][1]["num_prompt_tokens"] == 2
    assert r["all"]["positions"] == 28 and r["solution"]["positions"] == 13 + 3
    row = r["problems"][0]
    assert 0 <= row["max_abs_logit_diff_position"] < 23 and row["token_there"] == ord("def f(x):\n    return x\n"[
        row["max_abs_logit_diff_position"]]) % 96
    same = accuracy.run_teacher_forced(d, d, CharTokenizer(), problems, chunk=4, progress=False)
    assert same["solution"]["top1_agreement"] == 1.0 and same["all"]["max_abs_logit_diff"] == 0.0
    assert same["all"]["next_token_accuracy_ref"] == same["all"]["next_token_accuracy_test"]


def test_whole_output_agreement():
    a = [[1, 2, 3], [4, 5], [6], None]
    b = [[1, 2, 3], [4, 9, 9], None, [1]]
    r = accuracy.agreement(a, b)
    assert r["n"] == 2 and r["identical"] == 1 and r["fraction_identical"] == 0.5
    assert r["common_prefix"] == [3, 1] and r["mean_common_prefix"] == 2.0
    assert r["mean_length_a"] == 2.5 and r["mean_length_b"] == 3.0
    assert accuracy.agreement([None], [[1]])["n"] == 0
    assert accuracy.common_prefix([1, 2], [1, 2, 3]) == 2
    names = [(p["a"], p["b"]) for p in accuracy.pairs({"dense": b, "blocks": a})]
    assert names == [("blocks", "dense")]


def test_divergences_carry_the_reference_margin():
    from quickdraft.evaluation.measure import top2_margin

    d = _decoder()
    outputs = {"blocks": [[1, 2, 3], [7]], "dense": [[1, 2, 4], [7]], "llama_cpp": [[1, 2, 3], None]}
    found = accuracy.divergences(outputs, [[5, 6], [8]], d)
    assert [(x["a"], x["b"], x["problem"], x["position"]) for x in found] == [("blocks", "dense", 0, 2),
                                                                             ("dense", "llama_cpp", 0, 2)]
    assert found[0]["token_a"] == 3 and found[0]["token_b"] == 4
    assert found[0]["ref_margin"] == top2_margin(d, [5, 6, 1, 2])["margin"] >= 0


def test_llama_cpp_missing_is_a_skip(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "_installed", lambda peer: False)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"")
    r = accuracy.llama_cpp_outputs(str(f), [[1, 2], [3]], 8, {0}, 10.0, 64)
    assert r["status"] == "skipped" and "llama_cpp is not importable" in r["reason"] and r["outputs"] == [None, None]
    assert accuracy.llama_cpp_outputs(str(tmp_path), [[1]], 8, {0}, 10.0, 64)["status"] == "skipped"


def test_markdown_and_cli(tmp_path):
    from quickdraft.commands.cli import build_parser

    args = build_parser().parse_args(["bench", "accuracy", "--num-prompts", "3", "--no-llama-cpp", "--result-dir", str(tmp_path)])
    assert args.func is accuracy.run and args.num_prompts == 3
    c = accuracy.config_from_args(args)
    assert c.llama_cpp is False and "--no-llama-cpp" in accuracy.command_line(c, None)
    assert build_parser().parse_args(["bench", "--num-prompts", "3"]).func is not accuracy.run  # plain bench unchanged
    d = _decoder()
    tf = accuracy.run_teacher_forced(d, _decoder(noise=0.3), CharTokenizer(),
                                     [{"task_id": "t", "prompt": "ab", "canonical_solution": "cdef"}], 4, False)
    outputs = {"blocks": [[1, 2]], "dense": [[1, 3]]}
    result = {"config": accuracy.asdict(c), "command": accuracy.command_line(c, None),
              "machine": {"cpu": "cpu", "cpu_count": 2, "torch_threads": 2}, "duration_s": 1.0, "teacher_forced": tf,
              "greedy": {"task_ids": ["t"], "max_tokens": 2, "outputs": outputs, "pairs": accuracy.pairs(outputs),
                         "divergences": accuracy.divergences(outputs, [[5]], d),
                         "llama_cpp": {"status": "skipped", "reason": "--no-llama-cpp"}}}
    text = accuracy.markdown(result)
    assert "| all | 6 |" in text and "| solution | 4 |" in text
    assert "| blocks vs dense | 0/1 | 1.0 |" in text and "llama.cpp: skipped" in text
    assert "- blocks vs dense, t: first differ at token 1" in text
