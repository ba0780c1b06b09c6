"""Every family lossless under speculation, bit for bit: a tiny random model of each
(tests/models/families.py), in bfloat16, loaded from its Hugging Face directory, decodes the same
greedy tokens plainly and under every proposer (a draft model of the same family that agrees some
of the time, n-gram, suffix, layer skipping), on every instruction set this CPU runs (forced as
QUICKDRAFT_ISA forces it). Prompts run past the sliding window, so the window's keys are dropped
in the verification passes as in plain decoding's."""

from __future__ import annotations

import pytest
import torch

from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.engine.engine import Engine
from quickdraft import kernels
from quickdraft.kernels import isa
from quickdraft.models.loader import load_model
from quickdraft.models.tiny import perturbed
from quickdraft.sampling import SamplingParams
from tests.models.families import random_model, save_hf_dir

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
# a repeating prompt (n-gram and suffix find their drafts in it) past the window of 8 positions
PROMPTS = [[(3 * i) % 11 + 20 for i in range(30)], [5, 17, 33, 2, 9, 40, 41, 42, 43, 44, 45, 46]]
SPECS = {
    "draft_model": lambda target: {"method": "draft_model", "model": perturbed(target, 0.3, seed=3), "num_speculative_tokens": 4},
    "ngram": lambda target: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    "suffix": lambda target: {"method": "suffix", "num_speculative_tokens": 4},
    "layer_skip": lambda target: {"method": "layer_skip", "num_speculative_tokens": 3, "skip_layers": [1]},
}
HERE = [i.name for i in isa.ISAS if isa.runs_here(i)]


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict:
    out = {}
    for family in FAMILIES:
        path = save_hf_dir(random_model(family, seed=1), tmp_path_factory.mktemp(family) / "hf")
        out[family] = load_model(str(path), torch.bfloat16)
    return out


def generate(target, spec: dict | None) -> tuple[list[list[int]], object]:
    spec = None if spec is None else {"adaptive": False, **spec}
    config = EngineConfig(model="tiny", dtype="bfloat16", max_num_seqs=2, speculative=SpeculativeConfig.parse(spec))
    engine = Engine(config, target=target)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * len(PROMPTS)
    outs = engine.generate_ids(PROMPTS, params)
    return [o.token_ids for o in outs], engine.stats


@pytest.mark.parametrize("name", HERE)
@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_equals_plain_decoding(targets, family: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = kernels.build(isa.BY_NAME[name])
    if module is None:
        pytest.skip(f"the {name} kernels did not build")
    monkeypatch.setattr(kernels, "_module", lambda: module)
    target = targets[family]
    plain, _ = generate(target, None)
    for method, spec in SPECS.items():
        tokens, stats = generate(target, spec(target))
        assert tokens == plain, (family, name, method)
        assert stats.num_draft_tokens > 0, (family, name, method)  # it did speculate


def test_a_draft_of_another_family_with_the_same_tokenizer(targets) -> None:
    """A Qwen2 draft for a Qwen3 target (the pair shares a tokenizer): loaded, drafting, lossless."""
    plain, _ = generate(targets["qwen3"], None)
    tokens, stats = generate(targets["qwen3"], {"method": "draft_model", "model": targets["qwen2"], "num_speculative_tokens": 4})
    assert tokens == plain and stats.num_draft_tokens > 0
