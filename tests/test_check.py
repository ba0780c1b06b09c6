"""``quickdraft check``: passes on SmolLM2 with n-gram and with a draft model, in float32 and in
bfloat16; fails, naming the first diverging position, when the verifier is broken on purpose.
The real-weight runs are cut short by flags (fewer prompts, seeds and tokens) to stay fast."""

from __future__ import annotations

import json

import pytest

from quickdraft.commands.check import verdict
from quickdraft.commands.cli import main
from quickdraft.verify import step as verifier

SHORT = ["--num-prompts", "3", "--max-tokens", "12", "--num-seeds", "24", "--num-sampled-prompts", "1",
         "--sample-tokens", "4"]


def _check(capsys, smollm2_path, dtype: str, spec: dict, *flags: str) -> tuple[int, dict]:
    code = main(["check", "--model", str(smollm2_path), "--dtype", dtype, "--speculative-config", json.dumps(spec),
                 *flags, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_check_passes(capsys, smollm2_path, dtype, method):
    spec, flags = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}, SHORT
    if method == "draft_model":  # the target as its own int8 draft: shares the loaded (dequantized) weights
        spec = {"method": "draft_model", "model": str(smollm2_path), "num_speculative_tokens": 4,
                "quantization": "int8"}
        flags = SHORT + ["--quantization", "none"]
    code, r = _check(capsys, smollm2_path, dtype, spec, *flags)
    assert (code, r["verdict"], r["failures"]) == (0, "PASS", [])
    assert r["greedy"]["identical"] == r["greedy"]["num_prompts"] == 3
    assert sum(p["num_accepted_tokens"] for p in r["greedy"]["prompts"]) > 0  # speculation was exercised
    s = r["sampled"]
    assert s["n"] == 1 and s["p_value"] >= s["alpha"] and s["prompts"][0]["num_accepted_tokens"] > 0
    names = {p["name"] for p in r["kernels"]["probes"]}
    assert {"self_attn.q_proj", "mlp.down_proj", "lm_head", "decoder"} <= names
    if r["kernels"]["promise"]["promised"]:
        assert r["kernels"]["invariant"] and not r["warnings"]


@pytest.mark.slow
def test_a_broken_verifier_fails(capsys, smollm2_path, monkeypatch):
    """A verifier that, after a rejection, accepts every draft token anyway: check exits 1 and
    names the position where the speculative output leaves plain decoding. Broken in both of the
    step's chain verifiers (verify/step.py): ``verify``, and ``greedy_walk``, which all-greedy batches go to."""

    def accepts_everything(real):
        def broken(draft_token_ids, num_tokens, *rest):
            out = real(draft_token_ids, num_tokens, *rest)
            drafts, start = draft_token_ids.tolist(), 0
            for i, k in enumerate(num_tokens):
                if k and out.num_accepted[i] < k:
                    out.token_ids[i] = drafts[start : start + k] + out.token_ids[i][-1:]
                    out.num_accepted[i] = k
                start += k
            return out
        return broken

    monkeypatch.setattr(verifier, "verify", accepts_everything(verifier.verify))
    monkeypatch.setattr(verifier, "greedy_walk", accepts_everything(verifier.greedy_walk))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    code, r = _check(capsys, smollm2_path, "float32", spec, "--num-prompts", "3", "--max-tokens", "24",
                     "--num-seeds", "32", "--num-sampled-prompts", "1", "--sample-tokens", "6")
    assert code == 1 and r["verdict"] == "FAIL"
    bad = [p for p in r["greedy"]["prompts"] if not p["identical"]]
    assert bad and all(p["position"] >= 0 and p["margin"] >= 0 for p in bad)
    assert f"diverges at position {bad[0]['position']}" in r["failures"][0]
    assert r["sampled"]["p_value"] < r["sampled"]["alpha"] and r["failures"][-1].startswith("sampled:")


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    assert main(["check", "--model", "smollm2-135m-instruct"]) == 2
    assert "needs --speculative-config" in capsys.readouterr().err
    missing = tmp_path / "nope.jsonl"
    assert main(["check", "--speculative-config", '{"method": "ngram"}', "--prompts", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    assert main(["check", "--speculative-config", '{"method": "ngram"}', "--temperature", "0"]) == 2
    assert "--temperature" in capsys.readouterr().err
    assert main(["check", "--speculative-config", '{"method": "ngram"}', "--permutations", "100"]) == 2
    assert "--permutations must be at least 1000" in capsys.readouterr().err


def _result(promised: bool, probe_ok: bool, identical: bool = True, p_value: float = 0.5, drafts: int = 9) -> dict:
    probe = {"name": "mlp.down_proj", "invariant": probe_ok, "first_bad_rows": None if probe_ok else 13}
    row = {"prompt": "code", "identical": identical, "num_draft_tokens": drafts}
    if not identical:
        row.update(position=5, plain_token=1, speculative_token=2, margin=1e-3, rounding_level=True)
    return {"kernels": {"promise": {"promised": promised, "path": "torch-cpu", "why": "QUICKDRAFT_KERNELS=0"},
                        "probes": [probe]},
            "greedy": {"prompts": [row]}, "sampled": {"p_value": p_value, "tv": 0.1, "tv_null": 0.1}}


def test_verdict():
    assert verdict(_result(True, True), 1e-3)["verdict"] == "PASS"
    broken = verdict(_result(True, False), 1e-3)  # a promise broken on this machine
    assert broken["verdict"] == "FAIL" and "mlp.down_proj (from 13 rows)" in broken["failures"][0]
    unpromised = verdict(_result(False, False), 1e-3)  # nothing promised: a warning while outputs agree
    assert unpromised["verdict"] == "PASS" and len(unpromised["warnings"]) == 2
    diverged = verdict(_result(False, False, identical=False), 1e-3)
    assert diverged["verdict"] == "FAIL" and "position 5" in diverged["failures"][0]
    assert "near-tie" in diverged["failures"][0]
    assert verdict(_result(True, True, p_value=1e-4), 1e-3)["verdict"] == "FAIL"
    idle = verdict(_result(True, True, drafts=0), 1e-3)  # nothing drafted: nothing verified
    assert idle["verdict"] == "PASS" and "no draft token" in idle["warnings"][0]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma3"])
def test_check_passes_on_every_family(capsys, tmp_path, family):
    """A tiny random model of each family (tests/models/families.py: Llama 3's rope scaling,
    Mistral's window, Qwen3's q/k norms, Gemma 3's local and global layers) from its Hugging Face
    directory."""
    from tests.models.families import random_model, save_hf_dir

    path = save_hf_dir(random_model(family, seed=2), tmp_path / "hf")
    prompts = tmp_path / "prompts.jsonl"  # short: the tiny models hold 128 positions
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("abcabcabcabc", "hello hello", "xyz")))
    spec = {"method": "layer_skip", "num_speculative_tokens": 3, "skip_layers": [1]}
    code, r = _check(capsys, path, "bfloat16", spec, *SHORT, "--prompts", str(prompts), "--max-tokens", "24")
    assert (code, r["verdict"], r["failures"]) == (0, "PASS", [])
    assert r["greedy"]["identical"] == r["greedy"]["num_prompts"] == 3
    assert sum(p["num_draft_tokens"] for p in r["greedy"]["prompts"]) > 0
