"""A tiny random target and heads trained on its own greedy continuations (self-distillation), in
a few seconds: what the training and proposer tests share."""

from __future__ import annotations

import pytest
import torch

from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.engine.engine import Engine
from quickdraft.models.loader import LoadedModel
from quickdraft.models.tiny import random_weights, tiny_config
from quickdraft.sampling import SamplingParams

CONFIG = tiny_config("qwen2", vocab_size=96, hidden_size=64, num_layers=4)
TARGET = LoadedModel(CONFIG, random_weights(CONFIG, seed=1, scale=2.0), None, "tiny-target")
PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42, 43, 44, 45, 46, 47, 1, 2, 3], [7]]


def run(spec: dict | None, prompts, params, target=TARGET, max_num_seqs=4):
    """Generate with a fixed K (the adaptive plan reads timings)."""
    if spec is not None:
        spec = {"adaptive": False, **spec}
    config = EngineConfig(model="tiny", dtype="float32", max_num_seqs=max_num_seqs,
                          speculative=SpeculativeConfig.parse(spec))
    engine = Engine(config, target=target)
    return engine.generate_ids(prompts, params), engine.stats


@pytest.fixture(scope="session")
def tiny_windows():
    """The target's greedy continuations of 96 random prompts (none of them PROMPTS), labelled by
    one teacher-forced pass: 48-token windows of text the target itself writes."""
    from quickdraft.train.data import label

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CONFIG.vocab_size, (4,), generator=g).tolist() for _ in range(96)]
    params = [SamplingParams(max_tokens=44, temperature=0, ignore_eos=True)] * 32
    outs = [o for a in range(0, len(prompts), 32) for o in run(None, prompts[a : a + 32], params, max_num_seqs=8)[0]]
    return label(TARGET, [p + o.token_ids for p, o in zip(prompts, outs)])


@pytest.fixture(scope="session")
def greedy_params():
    return [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)


@pytest.fixture(scope="session")
def plain(greedy_params):
    return [o.token_ids for o in run(None, PROMPTS, greedy_params)[0]]
