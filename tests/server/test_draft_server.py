"""A draft model under a grammar, with the real ``openai`` client against ``quickdraft serve``
(SmolLM2-135M, float32): a json_schema response_format gives the same greedy text with the draft
model speculating as without speculation, streaming and not, for a draft of the target's
vocabulary (its q masked by the grammar, proposers/draft/model.py) and one that drafts through
text (``cross_tokenizer``, proposers/draft/text.py)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from qd_server import API_KEY, MODEL, ServerProcess

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"language": {"type": "string", "maxLength": 20},
                                           "year": {"type": "integer", "minimum": 1900},
                                           "paradigms": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                                         "maxItems": 3}},
          "required": ["language", "year", "paradigms"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "language", "schema": SCHEMA, "strict": True}}
ASKS = [[{"role": "user", "content": "Describe the Python programming language as JSON."}],
        [{"role": "user", "content": "Give me a JSON description of C."}]]
DRAFTS = {
    "same vocabulary": {"method": "draft_model", "model": MODEL, "num_speculative_tokens": 4, "adaptive": False,
                        "quantization": None, "draft_confidence_threshold": 0.0},
    "through text": {"method": "draft_model", "model": MODEL, "cross_tokenizer": True, "num_speculative_tokens": 4,
                     "adaptive": False, "quantization": None, "draft_confidence_threshold": 0.0},
}


@pytest.fixture(scope="module", params=list(DRAFTS))
def draft_client(request):
    server = ServerProcess("--max-num-seqs", "2", "--speculative-config", json.dumps(DRAFTS[request.param]),
                           log_name=f"draft-{request.param.replace(' ', '-')}")
    request.addfinalizer(server.stop)
    server.wait_ready()
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_json_schema_same_with_the_draft_model_and_without(draft_client, plain_client):
    for ask in ASKS:
        kw = dict(model=MODEL, messages=ask, max_tokens=64, temperature=0, response_format=FORMAT)
        spec, plain = draft_client.chat.completions.create(**kw), plain_client.chat.completions.create(**kw)
        text = spec.choices[0].message.content
        assert text == plain.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert spec.choices[0].finish_reason == "stop"
        usage = spec.usage.model_extra["speculative"]
        assert usage["num_accepted_tokens"] > 0  # the draft model's tokens, besides the grammar's forced ones
        streamed = draft_client.chat.completions.create(**kw, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
