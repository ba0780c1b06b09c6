"""End to end on real weights (SmolLM2-135M-Instruct): speculative greedy output equals plain greedy
output token for token, for n-gram lookup, suffix decoding, a draft model and layer skipping, in float32 and in bfloat16, on
dequantized weights and on the GGUF file's blocks as stored.

bfloat16 is exact too, not only float32: every op of the decoder is batch invariant (see
models/decoder/), so a verification pass over K + 1 tokens rounds each row exactly as the
single-token pass of plain decoding would. No tolerance anywhere in this file."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.models.ggml import BlockWeight
from quickdraft.models.loader import load_model
from quickdraft.models.quant import Int8Weight

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is Paris. The capital of Italy is Rome. The capital of France is",
    "<|im_start|>user\nList the first five prime numbers, one per line.<|im_end|>\n<|im_start|>assistant\n",
]
PARAMS = SamplingParams(max_tokens=40, temperature=0)


@pytest.fixture(scope="module", params=["float32", "bfloat16", "gguf-bfloat16"])
def target(request, smollm2_path):
    """gguf-*: the file's Q4_1 / Q8_0 blocks as stored (models/ggml.py), activations in that dtype."""
    quantization, _, dtype = request.param.rpartition("-")
    return dtype, load_model(str(smollm2_path), getattr(torch, dtype), quantization=quantization or None)


@pytest.fixture(scope="module")
def plain(target):
    dtype, model = target
    return [o.token_ids for o in LLM(model, dtype=dtype).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1, "adaptive": False},
    {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4, "prompt_lookup_min": 2, "adaptive": False},
    # token trees: up to 3 continuations merged into 6 nodes a step, scored in one pass
    {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3, "prompt_lookup_min": 1, "num_branches": 3,
     "adaptive": False},
])
def test_ngram_equals_plain(target, plain, spec):
    dtype, model = target
    llm = LLM(model, speculative_config=spec, dtype=dtype)
    trees = []
    propose = llm.engine.runner.proposer.propose
    llm.engine.runner.proposer.propose = lambda seqs, k: trees.append(p := propose(seqs, k)) or p
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == plain
    assert llm.engine.stats.num_accepted_tokens > 0  # the repeated-capital prompt gets accepted drafts
    if spec.get("num_branches", 1) > 1:  # branching trees were drafted, not only chains
        assert any(t is not None and len(set(t)) < len(t) for p in trees for t in (p.parents or []))


@pytest.mark.parametrize("spec", [
    {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
    {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_min_token_prob": 0.0,
     "suffix_decoding_max_spec_factor": 2.0, "adaptive": False},
    # token trees: up to 3 children a node, best-first, 8 nodes a step
    {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_min_token_prob": 0.0, "num_branches": 3,
     "adaptive": False},
])
def test_suffix_equals_plain(target, plain, spec):
    """Twice on one engine: the second run drafts from the first run's outputs (the global cache)
    as well as from its own text, and accepts more."""
    dtype, model = target
    llm = LLM(model, speculative_config=spec, dtype=dtype)
    accepted = []
    for _ in range(2):
        outs = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == plain
        accepted.append(sum(o.spec.num_accepted_tokens for o in outs))
    assert 0 < accepted[0] < accepted[1]


@pytest.mark.parametrize("k", [4, 15])
def test_self_draft_accepts_everything(target, plain, k):
    """The model as its own draft: every draft token accepted, output unchanged. K=15 verifies 16
    rows a pass, which on the GGUF blocks runs on AMX where the CPU has it (kernels/blocks.cpp)."""
    dtype, model = target
    llm = LLM(model, speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": k,
                                         "quantization": None, "draft_confidence_threshold": 0.0,
                                         "adaptive": False}, dtype=dtype)
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == plain
    assert llm.engine.stats.acceptance_rate == 1.0


def test_int8_draft_changes_only_the_speed(target, plain):
    """A quantized draft proposes differently; the target's verification keeps the output."""
    dtype, model = target
    if isinstance(model.weights["lm_head.weight" if "lm_head.weight" in model.weights else "model.embed_tokens.weight"], BlockWeight):
        pytest.skip("GGUF blocks are smaller than int8 already: no int8 draft of them")
    llm = LLM(model, speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 4,
                                         "quantization": "int8", "adaptive": False}, dtype=dtype)
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == plain
    assert isinstance(llm.engine.proposer.model.lm_head, Int8Weight)
    assert llm.engine.stats.acceptance_rate > 0.5


def test_draft_model_trees_equal_plain(target, plain):
    """Token trees from a draft that disagrees at times (int8, or Q4_0 blocks on the GGUF target),
    grown a level a draft pass: the accepted path's draft keys moved into place, the target's
    tree verified in one pass."""
    dtype, model = target
    stored = isinstance(model.weights["model.embed_tokens.weight"], BlockWeight)
    llm = LLM(model, speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 4,
                                         "num_branches": 3, "quantization": "q4_0" if stored else "int8",
                                         "adaptive": False}, dtype=dtype)
    trees = []
    propose = llm.engine.runner.proposer.propose
    llm.engine.runner.proposer.propose = lambda seqs, k: trees.append(p := propose(seqs, k)) or p
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain
    assert any(t is not None and len(set(t)) < len(t) for p in trees for t in (p.parents or []))
    assert llm.engine.stats.num_accepted_tokens > 0


def test_batched_equals_alone(target, plain):
    dtype, model = target
    llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, dtype=dtype)
    alone = [llm.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    assert alone == plain


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    {"method": "suffix", "num_speculative_tokens": 8},
    {"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 4},
])
def test_adaptive_plan_changes_only_the_speed(target, plain, spec):
    """The default: K is planned per sequence and step from timings (engine/plan.py), so which
    drafts are verified varies from run to run; the tokens may not."""
    dtype, model = target
    spec = {**spec, "model": model} if "model" in spec else spec
    llm = LLM(model, speculative_config=spec, dtype=dtype)
    assert llm.engine.runner.target_cost is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain


@pytest.mark.parametrize("spec", [
    # the whole model: the draft is the target, so every draft is accepted (the shared cache is exact)
    {"method": "layer_skip", "num_speculative_tokens": 4, "skip_layers": [], "draft_confidence_threshold": 0.0,
     "adaptive": False},
    # the skip set searched on the fly (scoring passes over committed rows, restored after), K fixed
    {"method": "layer_skip", "num_speculative_tokens": 4, "adaptive": False},
])
def test_layer_skip_equals_plain(target, plain, spec):
    """The target drafts for itself with sublayers skipped, in its own KV cache (proposers/draft/layer_skip.py)."""
    dtype, model = target
    llm = LLM(model, speculative_config=spec, dtype=dtype)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain
    stats, proposer = llm.engine.stats, llm.engine.proposer
    if spec.get("skip_layers") == []:
        assert stats.acceptance_rate == 1.0
    else:
        assert proposer.search.trials > 0 and 0 < stats.acceptance_rate < 1
