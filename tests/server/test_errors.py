"""Bad input: each gets OpenAI's error format with the right status and a message that names the
problem, and each is counted in ``quickdraft:request_failure_total{reason}``."""

from __future__ import annotations

import httpx
import pytest
import torch
from qd_server import MAX_MODEL_LEN, MODEL

from quickdraft.kernels import block_linear, invariance

pytestmark = pytest.mark.slow

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
MSG = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

# (id, path, body (dict, or raw bytes), headers override, status, message fragment, param)
CASES = [
    ("malformed-json", C, b'{"model": "x", "prompt": ', None, 400, "not valid JSON", None),
    ("not-an-object", C, b"[1, 2]", None, 400, "must be a JSON object", None),
    ("missing-prompt", C, {"model": MODEL}, None, 400, "prompt is required", "prompt"),
    ("max-tokens-string", C, {**OK, "max_tokens": "5"}, None, 400, "valid integer", "max_tokens"),
    ("n-float", C, {**OK, "n": 1.5}, None, 400, "valid integer", "n"),
    ("stream-not-bool", C, {**OK, "stream": "yes"}, None, 400, "valid boolean", "stream"),
    ("prompt-wrong-type", C, {**OK, "prompt": 42}, None, 400, "prompt must be a string", "prompt"),
    ("unknown-field", C, {**OK, "max_tokenz": 3}, None, 400, "unrecognized request argument(s): max_tokenz",
     "max_tokenz"),
    ("temperature-range", C, {**OK, "temperature": 2.5}, None, 400, "less than or equal to 2", "temperature"),
    ("top-p-zero", C, {**OK, "top_p": 0}, None, 400, "greater than 0", "top_p"),
    ("max-tokens-zero", C, {**OK, "max_tokens": 0}, None, 400, "at least 1, or 0 with echo", "max_tokens"),
    ("n-zero", C, {**OK, "n": 0}, None, 400, "greater than or equal to 1", "n"),
    ("top-k-range", C, {**OK, "top_k": -2}, None, 400, "greater than or equal to -1", "top_k"),
    ("token-out-of-vocab", C, {**OK, "prompt": [1, 2, 10**9]}, None, 400, "token ids must lie in", "prompt"),
    ("prompt-too-long", C, {**OK, "prompt": [17] * (MAX_MODEL_LEN + 5)}, None, 400, "the context holds", "prompt"),
    ("too-many-stops", C, {**OK, "stop": [str(i) for i in range(17)]}, None, 400, "at most 16", "stop"),
    ("logprobs-range", C, {**OK, "logprobs": 21}, None, 400, "less than or equal to 20", "logprobs"),
    ("top-logprobs-alone", CHAT, {"model": MODEL, "messages": MSG, "top_logprobs": 2}, None, 400,
     "top_logprobs needs logprobs: true", "top_logprobs"),
    ("penalty-range", C, {**OK, "presence_penalty": 2.5}, None, 400, "less than or equal to 2", "presence_penalty"),
    ("bias-key", C, {**OK, "logit_bias": {"abc": 1}}, None, 400, "logit_bias keys must be token ids", "logit_bias"),
    ("bias-token-range", C, {**OK, "logit_bias": {"999999999": 1}}, None, 400, "token ids that must lie in [0,", "logit_bias"),
    ("bias-value", C, {**OK, "logit_bias": {"5": 101}}, None, 400, "must be in [-100, 100]", "logit_bias"),
    ("repetition-zero", C, {**OK, "repetition_penalty": 0}, None, 400, "greater than 0", "repetition_penalty"),
    ("stream-options-without-stream", C, {**OK, "stream_options": {"include_usage": True}}, None, 400,
     "only allowed when stream is true", "stream_options"),
    ("chat-empty-messages", CHAT, {"model": MODEL, "messages": []}, None, 400, "at least 1 item", "messages"),
    ("chat-bad-role", CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "'system', 'developer', 'user', 'assistant' or 'tool'", "messages.0.role"),
    ("chat-content-type", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, None, 400,
     "content must be a string", "messages.0.content"),
    ("chat-tool-malformed", CHAT, {"model": MODEL, "messages": MSG, "tools": [{"type": "function"}]}, None, 400,
     'each tool must be {"type": "function"', "tools.0"),
    ("tool-choice-unknown-name", CHAT, {"model": MODEL, "messages": MSG, "tools": [TOOL], "tool_choice":
     {"type": "function", "function": {"name": "nope"}}}, None, 400, "names the function 'nope'", "tool_choice"),
    ("tool-choice-required-without-tools", CHAT, {"model": MODEL, "messages": MSG, "tool_choice": "required"}, None,
     400, "needs tools", "tool_choice"),
    ("response-format-unknown-type", CHAT, {"model": MODEL, "messages": MSG, "response_format": {"type": "xml"}}, None,
     400, "response_format type must be", "response_format.type"),
    ("json-schema-missing", CHAT, {"model": MODEL, "messages": MSG, "response_format": {"type": "json_schema"}}, None,
     400, "needs", "response_format.json_schema"),
    ("json-schema-does-not-compile", CHAT, {"model": MODEL, "messages": MSG, "response_format": {
     "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     None, 400, "does not compile", "response_format.json_schema.schema"),
    ("bad-regex", C, {**OK, "structured_outputs": {"regex": "(ab"}}, None, 400, "does not compile",
     "structured_outputs.regex"),
    ("bad-grammar", C, {**OK, "structured_outputs": {"grammar": "root ::= ("}}, None, 400, "does not compile",
     "structured_outputs.grammar"),
    ("two-structured-kinds", C, {**OK, "structured_outputs": {"regex": "a", "choice": ["a"]}}, None, 400,
     "exactly one of", "structured_outputs"),
    ("format-and-extension", C, {**OK, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     None, 400, "not both", "structured_outputs"),
    ("tool-choice-and-format", CHAT, {"model": MODEL, "messages": MSG, "tools": [TOOL], "tool_choice": "required",
     "response_format": {"type": "json_object"}}, None, 400, "cannot be combined", "tool_choice"),
    ("unknown-model", C, {**OK, "model": "gpt-5"}, None, 404, "the model 'gpt-5' does not exist", "model"),
    ("unknown-route", "/v1/embeddings", {**OK}, None, 404, "Not Found", None),
    ("no-api-key", C, OK, {}, 401, "missing API key", None),
    ("wrong-api-key", C, OK, {"Authorization": "Bearer nope"}, 401, "incorrect API key", None),
]
REASON = {400: "bad_request", 401: "unauthorized", 404: "not_found"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(plain_server, case):
    _, path, body, headers, status, fragment, param = case
    before = plain_server.metrics()
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(plain_server.url + path, headers=plain_server.headers if headers is None else headers,
                   timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"], err
    assert err["param"] == param
    assert err["type"] == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}[status]
    key = ("quickdraft:request_failure_total", (("reason", REASON[status]),))
    assert plain_server.metrics()[key] == before[key] + 1


def test_good_request_after_bad_ones(plain_server):
    r = httpx.post(plain_server.url + C, json=OK, headers=plain_server.headers, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_health_version_metrics_open(plain_server):
    assert httpx.get(plain_server.url + "/health").json()["status"] == "ok"
    version = httpx.get(plain_server.url + "/version").json()
    assert version["version"] and version["batch_invariance"]["path"]
    # the test server runs float32, SmolLM2's GGUF on its stored blocks where the kernels run (the default)
    assert version["batch_invariance"] == invariance(torch.float32, "cpu", blocks=block_linear() is not None).to_dict()
    m = plain_server.metrics()  # parsed with prometheus_client.parser
    for name in ("quickdraft:spec_decode_num_drafts_total", "quickdraft:spec_decode_num_draft_tokens_total",
                 "quickdraft:spec_decode_num_accepted_tokens_total", "quickdraft:prompt_tokens_total",
                 "quickdraft:generation_tokens_total", "quickdraft:num_requests_running",
                 "quickdraft:num_requests_waiting", "quickdraft:time_to_first_token_seconds_count",
                 "quickdraft:time_per_output_token_seconds_count", "quickdraft:e2e_request_latency_seconds_count"):
        assert (name, ()) in m, name
    assert ("quickdraft:request_success_total", (("finished_reason", "stop"),)) in m
    assert ("quickdraft:request_failure_total", (("reason", "queue_full"),)) in m
