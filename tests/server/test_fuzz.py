"""Fuzzing from the server's own OpenAPI schema (``/openapi.json``) with hypothesis-jsonschema,
against the real server on loopback with SmolLM2-135M.

Each case is one POST to a route of the schema: a body the schema allows, the same with one
field replaced by any JSON value, any JSON value at all, or any bytes. The property: no 5xx, no
dropped connection, every 4xx in OpenAI's error format, every stream's events JSON with no 5xx
error among them; afterwards the server is healthy and its greedy output is what it was before.

``QD_FUZZ_CASES`` sets the number of cases (default 300); ``QD_FUZZ_SEED`` a seed, where the
default is hypothesis's derandomized run (the same cases every time)."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from qd_server import MODEL

hypothesis = pytest.importorskip("hypothesis", reason="pip install hypothesis hypothesis-jsonschema")
hjs = pytest.importorskip("hypothesis_jsonschema", reason="pip install hypothesis-jsonschema")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow

CASES = int(os.environ.get("QD_FUZZ_CASES", "300"))
SEED = os.environ.get("QD_FUZZ_SEED")
GREEDY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
# Generation is the costly part: each case may ask for a few tokens and choices, never hundreds.
MAX_NEW_TOKENS, MAX_CHOICES = 4, 2

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                    max_leaves=12)


def _bounded(body):
    """The case as sent: the served model most of the time (else every case is a 404), and at
    most MAX_NEW_TOKENS tokens and MAX_CHOICES choices where those are integers."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool):
            body[key] = min(body[key], MAX_NEW_TOKENS)
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_NEW_TOKENS  # chat's default is the rest of the context
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = min(body["n"], MAX_CHOICES)
    if isinstance(body.get("best_of"), int) and not isinstance(body["best_of"], bool):
        body["best_of"] = min(body["best_of"], MAX_CHOICES)
    return body


def _cases(schema: dict):
    """(path, body: JSON value or raw bytes) strategies over the schema's POST routes."""
    routes = {path: op["post"]["requestBody"]["content"]["application/json"]["schema"]
              for path, op in schema["paths"].items() if "post" in op and "requestBody" in op["post"]}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(routes)

    def valid(path):
        body = hjs.from_schema(routes[path])
        named = st.builds(lambda b, keep: b if keep else {**b, "model": MODEL}, body, st.integers(0, 4).map(lambda i: i == 0))
        return named.map(_bounded)

    def mutated(path):
        def swap(body, key, value):
            if isinstance(body, dict) and body:
                body = {**body, sorted(body)[key % len(body)]: value}
            return _bounded(body)
        return st.builds(swap, valid(path), st.integers(0, 50), JSON)

    paths = st.sampled_from(sorted(routes))
    return st.one_of(
        paths.flatmap(lambda p: st.tuples(st.just(p), valid(p))),
        paths.flatmap(lambda p: st.tuples(st.just(p), mutated(p))),
        st.tuples(paths, JSON),
        st.tuples(paths, st.binary(max_size=64)),
    )


def _check(r: httpx.Response, case) -> None:
    assert r.status_code < 500, (case, r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (case, r.text[:500])
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event or event["error"]["code"] < 500, (case, event)
    else:
        r.json()


def test_fuzz_from_openapi(edge_server, capsys):
    with httpx.Client(base_url=edge_server.url, headers=edge_server.headers, timeout=120) as client:
        before = client.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
        schema = client.get("/openapi.json").json()
        statuses: dict[int, int] = {}

        @settings(max_examples=CASES, deadline=None, database=None, derandomize=SEED is None,
                  suppress_health_check=list(HealthCheck))
        @given(_cases(schema))
        def run(case):
            path, body = case
            kw = {"content": body} if isinstance(body, bytes) else {"content": json.dumps(body)}
            r = client.post(path, headers={"Content-Type": "application/json"}, **kw)  # a dropped connection raises
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            _check(r, case)

        if SEED is not None:
            run = seed(int(SEED))(run)
        run()
        ran = sum(statuses.values())
        with capsys.disabled():  # shown in a plain `make test` too
            print(f"\nfuzz: {ran} cases from /openapi.json, statuses {dict(sorted(statuses.items()))}")
        assert client.get("/health").json()["status"] == "ok"
        assert client.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == before
    assert ran >= CASES and statuses.get(200, 0) > 0 and any(400 <= s < 500 for s in statuses)
