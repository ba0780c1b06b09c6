"""A draft requantized to 4 bits (``"quantization": "q4_0"``): its matrices are Q4_0 blocks, made
once and read back from the cache after, its drafts are still accepted, and the output stays the
target's (the verifier does not care how the draft was stored)."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.engine.engine import Engine
from quickdraft.errors import ConfigError
from quickdraft.models import ggml
from quickdraft.models.ggml import BlockWeight
from quickdraft.kernels import block_linear
from quickdraft.models.loader import load_model

MODEL = "smollm2-135m-instruct"
PROMPTS = ["def fibonacci(n):", "The three primary colors are"]


def test_requantize_is_ggmls_rounding_of_the_stored_values():
    """Q8_0 blocks -> Q4_0 blocks equal gguf's own Q4_0 of the Q8_0 blocks' values."""
    x = np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32)
    q8 = BlockWeight.from_gguf("Q8_0", gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0), (48, 64))
    q4 = ggml.requantize(q8, "Q4_0")
    values = q8.dequantize(torch.float32).numpy()
    want = gguf.quants.dequantize(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0),
                                  gguf.GGMLQuantizationType.Q4_0)
    assert q4.ggml_type == "Q4_0" and q4.shape == q8.shape
    assert np.array_equal(q4.dequantize(torch.float32).numpy(), want)
    dense = ggml.requantize(torch.from_numpy(x), "Q4_0")  # a dense matrix too
    assert dense.ggml_type == "Q4_0" and np.abs(dense.dequantize(torch.float32).numpy() - x).max() < 0.5


def test_an_unknown_draft_quantization_is_refused():
    with pytest.raises(ConfigError, match='"q4_0"') as e:
        SpeculativeConfig.parse({"method": "draft_model", "model": MODEL, "quantization": "q3"})
    assert e.value.param == "quantization"


@pytest.mark.slow
@pytest.mark.skipif(block_linear() is None, reason="the CPU kernels did not build")
def test_a_4_bit_draft_keeps_the_output_and_is_cached(smollm2_path, tmp_cache, monkeypatch):
    """SmolLM2 (Q4_1, 5 bits a weight) drafting for itself through Q4_0: every matrix but the
    embedding lookup's is Q4_0, the output is plain decoding's, and a second engine reads the
    requantized weights from the cache instead of making them again."""
    params = SamplingParams(max_tokens=24, temperature=0)
    spec = {"method": "draft_model", "model": MODEL, "num_speculative_tokens": 4, "quantization": "q4_0",
            "adaptive": False}
    with LLM(MODEL, dtype="bfloat16", max_model_len=256, max_num_seqs=2) as plain:
        want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    with LLM(MODEL, speculative_config=spec, dtype="bfloat16", max_model_len=256, max_num_seqs=2) as llm:
        draft = llm.engine.proposer.model
        kinds = {w.ggml_type for w in [*draft.w.values(), draft.lm_head] if isinstance(w, BlockWeight)}
        got = llm.generate(PROMPTS, params)
    assert kinds == {"Q4_0"}
    assert [o.token_ids for o in got] == want
    assert sum(o.spec.num_accepted_tokens for o in got) > 0  # the 4-bit draft still drafts what the target says

    def no_requantize(*args, **kwargs):
        raise AssertionError("requantized again")

    monkeypatch.setattr(ggml, "requantize", no_requantize)
    config = EngineConfig(model=MODEL, dtype="bfloat16", max_model_len=64, max_num_seqs=1,
                          speculative=SpeculativeConfig.parse(spec))
    again = Engine(config).proposer.model
    assert {w.ggml_type for w in again.w.values() if isinstance(w, BlockWeight)} == {"Q4_0"}

    # a draft handed in already loaded (as the bench does) is requantized too, and cached apart
    loaded = load_model(MODEL, torch.bfloat16, quantization="gguf")
    assert "Q4_0" not in {w.ggml_type for w in loaded.weights.values() if isinstance(w, BlockWeight)}  # as stored
    monkeypatch.undo()
    handed = Engine(EngineConfig(model=MODEL, dtype="bfloat16", max_model_len=64, max_num_seqs=1,
                                 speculative=SpeculativeConfig.parse({**spec, "model": loaded}))).proposer.model
    assert {w.ggml_type for w in handed.w.values() if isinstance(w, BlockWeight)} == {"Q4_0"}
    assert all(torch.equal(handed.w[n].data, again.w[n].data) for n in again.w if isinstance(again.w[n], BlockWeight))


def test_a_4_bit_draft_needs_the_block_kernels(smollm2_path, no_kernels):
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": MODEL, "quantization": "q4_0"})
    with pytest.raises(ConfigError, match="block kernels") as e:
        Engine(EngineConfig(model=MODEL, dtype="float32", max_model_len=64, max_num_seqs=1, speculative=spec))
    assert e.value.param == "quantization"


def test_auto_gives_a_gguf_draft_q4_0_and_null_keeps_it_stored(smollm2_path, tmp_cache, monkeypatch):
    """"auto" (the default) requantizes a GGUF draft on the block kernels as "q4_0" does, through
    the loader's own cached conversion (a draft loaded by name is not read as stored first); a
    draft given "quantization": null stays as its file stores it."""
    import quickdraft.proposers.draft.load as draft_load

    def config(**extra):
        spec = SpeculativeConfig.parse({"method": "draft_model", "model": MODEL, **extra})
        return EngineConfig(model=MODEL, dtype="bfloat16", max_model_len=64, max_num_seqs=1, speculative=spec)

    def formats(engine):
        return {w.ggml_type for w in engine.proposer.model.w.values() if isinstance(w, BlockWeight)}

    wider_left, real = [], draft_load.requantized

    def spy(draft, weights, kind, head):
        wider_left.extend(n for n, w in weights.items() if ggml.wider(w, kind))
        return real(draft, weights, kind, head)

    monkeypatch.setattr(draft_load, "requantized", spy)
    assert formats(Engine(config())) == {"Q4_0"}
    assert not wider_left  # the loader made the Q4_0 weights, not the path for a draft handed in loaded
    stored = formats(Engine(config(quantization=None)))
    assert "Q4_1" in stored and "Q4_0" not in stored


def test_auto_without_the_block_kernels_asks_for_no_4bit_draft(smollm2_path, no_kernels):
    """Where the kernels do not run, "auto" asks for no 4-bit draft, and blocks asked for anyway
    (quantization "gguf") are dequantized once at load, with a warning line, never at every call:
    no matrix stays in blocks, and nothing is refused."""
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": MODEL})
    with pytest.warns(UserWarning, match="dequantized once at load"):
        engine = Engine(EngineConfig(model=MODEL, dtype="float32", max_model_len=64, max_num_seqs=1, speculative=spec,
                                     quantization="gguf"))
    assert not any(isinstance(w, BlockWeight) for w in engine.proposer.model.w.values())
