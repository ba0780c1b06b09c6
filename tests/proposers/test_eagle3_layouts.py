"""An EAGLE-3 head in the EAGLE authors' published layout (EAGLE3-LLaMA3.1-Instruct-8B: a Llama config
with ``draft_vocab_size`` and Llama 3.1's rotary scaling, no target layers named, ``midlayer.*``,
``d2t``/``t2d`` and the target's embedding in ``pytorch_model.bin``) for a Llama 3 target (a tiny
random one, tests/models/families.py): it loads with EAGLE's own choice of target layers, turns
its queries and keys as transformers' Llama rotary embedding with that scaling does, and drafts
for the target losslessly. Its config follows a model's rule: a key not understood is an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.engine.engine import Engine
from quickdraft.errors import ConfigError
from quickdraft.models import eagle3 as head_file
from quickdraft.models.loader import load_model
from quickdraft.sampling import SamplingParams
from tests.models.families import random_model, save_hf_dir

transformers = pytest.importorskip("transformers")
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}
PROMPTS = [[(3 * i) % 11 + 20 for i in range(30)], [5, 17, 33, 2, 9, 40, 41, 42, 43, 44, 45, 46]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = save_hf_dir(random_model("llama", seed=4), tmp_path_factory.mktemp("llama3") / "hf")
    return load_model(str(path), torch.float32)


def eagle_layout(target, root: Path, **overrides) -> tuple[Path, head_file.Eagle3Head]:
    """A random head for ``target`` written as EAGLE writes its published heads."""
    torch.manual_seed(0)
    c = target.config
    ids = torch.randperm(c.vocab_size)[:64].sort().values
    config = head_file.Eagle3Config(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                    c.rms_norm_eps, 500000.0, c.max_position_embeddings, c.vocab_size, 64,
                                    head_file.default_aux_layers(c.num_layers), "", None, False,
                                    head_file.RopeScaling("llama3", 8.0, 16, 1.0, 4.0))
    head = head_file.Eagle3Head(config, ids)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    w = {k.replace("layers.0.", "midlayer."): v for k, v in head.state().items()}
    w["embed_tokens.weight"] = target.weights["model.embed_tokens.weight"].clone()
    root.mkdir(parents=True, exist_ok=True)
    torch.save(w, root / "pytorch_model.bin")
    doc = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "bos_token_id": 257, "eos_token_id": 258,
           "hidden_act": "silu", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "initializer_range": 0.02, "max_position_embeddings": c.max_position_embeddings,
           "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "num_hidden_layers": 1,
           "pretraining_tp": 1, "rms_norm_eps": c.rms_norm_eps, "rope_scaling": dict(LLAMA31_ROPE), "rope_theta": 500000.0,
           "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
           "vocab_size": c.vocab_size, "draft_vocab_size": 64, **overrides}
    (root / "config.json").write_text(json.dumps(doc))
    return root, head


def test_the_published_layout_loads_with_eagles_target_layers(target, tmp_path) -> None:
    path, made = eagle_layout(target, tmp_path / "eagle3")
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        head_file.load(path)  # no target to take the layers from
    head = head_file.load(path, target.config.num_layers)
    assert head.config.aux_layers == head_file.default_aux_layers(target.config.num_layers)
    assert head.config.rope_scaling == made.config.rope_scaling and head.config.rope_theta == 500000.0
    assert not head.config.norm_before_residual  # EAGLE's layout has no such norm
    assert torch.equal(head.draft_ids, made.draft_ids)
    x = torch.randn(5, target.config.hidden_size)
    assert torch.equal(head.logits(x), made.logits(x))


def test_the_head_turns_as_transformers_llama31_rotary(target, tmp_path) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head = head_file.load(eagle_layout(target, tmp_path / "eagle3")[0], target.config.num_layers)
    c = head.config
    cfg = transformers.LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_heads,
                                   max_position_embeddings=c.max_position_embeddings,
                                   rope_parameters={"rope_theta": 500000.0, **LLAMA31_ROPE})
    positions = torch.arange(100)  # past the original context of 16
    x = torch.randn(100, c.num_heads, c.head_dim)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, positions[None])
    theirs, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    mine = head_file.rotate(x, positions, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
    # float32 angles from float64 frequencies against transformers' float32 ones: 1e-5 at position 73
    torch.testing.assert_close(mine, theirs[0].transpose(0, 1), atol=5e-5, rtol=1e-4)
    plain = head_file.rotate(x, positions, c.rope_theta)
    assert (plain - mine).abs().max() > 0.1  # the scaling is what was checked


def test_it_drafts_for_a_llama3_target_losslessly(target, tmp_path) -> None:
    path, _ = eagle_layout(target, tmp_path / "eagle3")

    def generate(spec):
        config = EngineConfig(model="tiny", dtype="float32", max_num_seqs=2, speculative=SpeculativeConfig.parse(spec))
        engine = Engine(config, target=target)
        outs = engine.generate_ids(PROMPTS, [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 2)
        return [o.token_ids for o in outs], engine.stats

    plain, _ = generate(None)
    tokens, stats = generate({"method": "eagle3", "model": str(path), "num_speculative_tokens": 3, "adaptive": False})
    assert tokens == plain and stats.num_draft_tokens > 0


@pytest.mark.parametrize("overrides, words", [
    ({"some_new_knob": 1}, "some_new_knob"),
    ({"num_hidden_layers": 2}, "an EAGLE-3 head has one"),
    ({"target_hidden_size": 4096}, "target_hidden_size 4096"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({"hidden_act": "gelu"}, "SiLU"),
])
def test_a_key_not_understood_is_an_error(target, tmp_path, overrides: dict, words: str) -> None:
    path, _ = eagle_layout(target, tmp_path / "eagle3", **overrides)
    with pytest.raises(ConfigError, match=words):
        head_file.load(path, target.config.num_layers)


def test_a_head_for_a_gguf_llama3_target_saves_and_loads(tmp_path) -> None:
    """A Llama 3 GGUF states its scaling as per-frequency factors, which a head's config cannot:
    the head made for it turns as plain RoPE, and its file says so and reads back the same."""
    from tests.models.families import write_gguf

    gguf_target = load_model(str(write_gguf(random_model("llama", seed=4), "llama", tmp_path / "t.gguf")), torch.float32,
                             quantization="none")
    assert gguf_target.config.rope_scaling.kind == "factors"
    config = head_file.Eagle3Config.for_target(gguf_target, 64)
    assert config.rope_scaling is None
    head = head_file.Eagle3Head(config, torch.arange(64))
    loaded = head_file.load(head_file.save(head, tmp_path / "head"))
    assert loaded.config.rope_scaling is None and loaded.config.rope_theta == config.rope_theta
    x = torch.randn(3, config.hidden_size)
    assert torch.equal(loaded.logits(x), head.logits(x))
