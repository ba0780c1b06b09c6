"""Structured outputs end to end on SmolLM2-135M-Instruct in float32: under a grammar, greedy output
is the same token for token whether the step drafts nothing (plain constrained decoding), the
grammar's forced tokens, n-gram guesses or a draft model's, and it matches the grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.models.loader import load_model
from quickdraft.structured import StructuredSpec

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0},
                                           "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
          "required": ["name", "age", "skills"], "additionalProperties": False}


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


CASES = {
    "json schema": (chat("Describe a programmer as JSON."), StructuredSpec.json_schema(SCHEMA)),
    "json object": (chat("Give me a JSON object about Paris."), StructuredSpec.json_object()),
    "regex": (chat("What is the date of the moon landing?"), StructuredSpec("regex", r"\d{4}-\d{2}-\d{2}")),
    "choice": (chat("Is the sky blue? Answer yes or no."), StructuredSpec.choice(["yes", "no", "maybe"])),
}
PROMPTS = [p for p, _ in CASES.values()]
SPECS = [s for _, s in CASES.values()]


@pytest.fixture(scope="module")
def target(smollm2_path):
    return load_model(str(smollm2_path), __import__("torch").float32)


def run(model, spec=None, **params):
    llm = LLM(model, speculative_config=spec, dtype="float32")
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=48, temperature=0, structured=s, **params) for s in SPECS])
    return llm, outs


@pytest.fixture(scope="module")
def plain(target):
    """Plain constrained decoding: no drafts of any kind (the request's own cap of 0)."""
    return [o.token_ids for o in run(target, num_speculative_tokens=0)[1]]


def check(outs) -> None:
    by_name = dict(zip(CASES, outs))
    jsonschema.validate(json.loads(by_name["json schema"].text), SCHEMA)
    obj = by_name["json object"]  # any object: it may run to max_tokens
    assert obj.text.startswith("{") and (obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict))
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", by_name["regex"].text)
    assert by_name["choice"].text in ("yes", "no", "maybe")
    # the grammar completed: the sequence stopped
    assert all(by_name[n].finish_reason == "stop" for n in ("json schema", "regex", "choice"))


def test_plain_matches_the_grammar(target, plain):
    check(run(target, num_speculative_tokens=0)[1])


@pytest.mark.parametrize("spec", [
    None,  # the grammar's forced tokens alone
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1, "adaptive": False},
    "self-draft",
])
def test_drafts_change_only_the_speed(target, plain, spec):
    if spec == "self-draft":  # the model as its own draft, sampling-free: it proposes outside the grammar too
        spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3, "quantization": None,
                "adaptive": False}
    llm, outs = run(target, spec)
    assert [o.token_ids for o in outs] == plain
    check(outs)
    assert llm.engine.stats.num_accepted_tokens > 0  # forced keys and punctuation come with fewer passes


def test_sampled_drafts_stay_in_the_grammar(target):
    """Sampling under the mask with a sampled draft (q unmasked, drafts cut by the grammar)."""
    llm = LLM(target, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3,
                                          "quantization": None, "adaptive": False}, dtype="float32")
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=48, temperature=1.0, seed=5, structured=s) for s in SPECS])
    check(outs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_self_draft_samples_under_the_grammar(target, plain, temperature):
    """The model as its own draft, its q masked by the grammar walked along its own draft tokens:
    q is the masked target p at every position, so every token it drafts is accepted (the drafts
    of the grammar's forced tokens aside: point masses the target may spell otherwise). Without the
    mask the draft proposed outside the grammar and lost those tokens. Greedy, the output is plain's."""
    llm = LLM(target, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3,
                                          "quantization": None, "adaptive": False, "draft_confidence_threshold": 0.0},
              dtype="float32")
    results = []
    step = llm.engine.runner.step
    llm.engine.runner.step = lambda *a, **kw: results.extend(r := step(*a, **kw)) or r
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=48, temperature=temperature, seed=5, structured=s)
                                  for s in SPECS])
    check(outs)
    if temperature == 0.0:
        assert [o.token_ids for o in outs] == plain
    own = [(r.num_drafts, r.num_accepted) for r in results if r.num_drafts and not r.forced]
    assert len(own) > 5 and all(d == a for d, a in own)
