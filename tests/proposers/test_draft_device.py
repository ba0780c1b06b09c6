"""``draft_device``: where the draft model runs. What a CPU-only machine can test: the key is
checked when parsed, a device this machine lacks is a clear error before any weights load, and a
draft placed on the CPU by the key (loaded by name, on that device) keeps the output plain
decoding's. The CUDA placements (a CPU draft beside a GPU target, a draft on another GPU) need a
GPU: ``test_draft_on_cpu_beside_a_gpu_target`` runs where there is one."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.engine.engine import Engine
from quickdraft.errors import ConfigError
from quickdraft.models.loader import LoadedModel
from quickdraft.models.tiny import random_weights, tiny_config

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "CPU", "", 3])
def test_a_malformed_device_is_refused_when_parsed(value):
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.parse({"method": "draft_model", "model": MODEL, "draft_device": value})
    assert e.value.param == "draft_device"


def test_draft_device_is_for_draft_models():
    with pytest.raises(ConfigError, match='for method "draft_model"'):
        SpeculativeConfig.parse({"method": "ngram", "draft_device": "cpu"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_missing_device_is_a_clear_error_before_loading(device):
    config = tiny_config()
    target = LoadedModel(config, random_weights(config, seed=1), None, "tiny")
    spec = SpeculativeConfig(method="draft_model", model="no-such-model-is-loaded", draft_device=device)
    with pytest.raises(ConfigError, match="no CUDA device") as e:
        Engine(EngineConfig(model="tiny", dtype="float32", max_num_seqs=1, max_model_len=32, speculative=spec),
               target=target)
    assert e.value.param == "draft_device"


@pytest.mark.slow
def test_a_draft_placed_on_the_cpu_keeps_the_output(smollm2_path):
    """SmolLM2 drafting for itself, loaded by name onto the device the key names."""
    params = SamplingParams(max_tokens=16, temperature=0)
    spec = {"method": "draft_model", "model": MODEL, "num_speculative_tokens": 3, "draft_device": "cpu",
            "adaptive": False}
    with LLM(MODEL, dtype="float32", max_model_len=128, max_num_seqs=2) as plain, \
            LLM(MODEL, speculative_config=spec, dtype="float32", max_model_len=128, max_num_seqs=2) as spec_llm:
        assert spec_llm.engine.proposer.model.device == torch.device("cpu")
        want = [o.token_ids for o in plain.generate(PROMPTS, params)]
        got = spec_llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == want
    assert sum(o.spec.num_accepted_tokens for o in got) > 0  # the draft ran and was accepted


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_draft_on_cpu_beside_a_gpu_target(smollm2_path):
    params = SamplingParams(max_tokens=16, temperature=0)
    spec = {"method": "draft_model", "model": MODEL, "num_speculative_tokens": 3, "draft_device": "cpu"}
    with LLM(MODEL, dtype="float32", device="cuda", max_model_len=128) as plain, \
            LLM(MODEL, speculative_config=spec, dtype="float32", device="cuda", max_model_len=128) as spec_llm:
        assert spec_llm.engine.proposer.model.device == torch.device("cpu")
        got = spec_llm.generate(PROMPTS, params)
        want = [o.token_ids for o in plain.generate(PROMPTS, params)]
        assert sum(o.spec.num_accepted_tokens for o in got) > 0
        if spec_llm.engine.decoder.batch_invariance.promised:  # cuBLAS promises no bits: then the first tokens
            assert [o.token_ids for o in got] == want
        else:
            assert [o.token_ids[:4] for o in got] == [w[:4] for w in want]
