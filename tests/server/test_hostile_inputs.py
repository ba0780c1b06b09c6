"""Hostile inputs: a body past --max-body-bytes, a 1 MB model name, 20,000 messages, a million
prompt token ids, a logit_bias with more keys than the vocabulary has tokens, 5,000 tools, 64 KB of
headers.
Each is refused (413 or 400, in OpenAI's error format, from the lengths alone) and the server
serves the next request as before. examples/hostile_inputs.py measures the memory they leave."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from qd_server import EDGE_MAX_BODY, MAX_MODEL_LEN, MODEL

C, CHAT = "/v1/completions", "/v1/chat/completions"
TURNS = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hello there"} for i in range(20_000)]
HOSTILE = [  # (id, path, body, status, OpenAI error code)
    ("body past the limit", C, b'{"model": "%s", "prompt": "%s"}' % (MODEL.encode(), b"x" * EDGE_MAX_BODY), 413,
     "request_too_large"),
    ("1 MB model name", C, json.dumps({"model": "m" * 2**20, "prompt": "Hi"}), 400, "model_name_too_long"),
    ("20,000 messages", CHAT, json.dumps({"model": MODEL, "messages": TURNS, "max_tokens": 1}), 400,
     "context_length_exceeded"),
    ("a million prompt ids", C, json.dumps({"model": MODEL, "prompt": [1] * 10**6, "max_tokens": 1}), 400,
     "context_length_exceeded"),
    ("5 MB prompt", C, json.dumps({"model": MODEL, "prompt": "x " * 2_500_000, "max_tokens": 1}), 400,
     "context_length_exceeded"),
    ("logit_bias past the vocabulary", C, json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                                      "logit_bias": {str(i): 1 for i in range(60_000)}}), 400, 400),
    ("5,000 tools", CHAT, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                      "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}}
                                                for i in range(5_000)]}), 400, "array_above_max_length"),
]


def _openai_error(r: httpx.Response, status: int, code: str | int) -> None:
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == code, error
    assert len(r.content) < 4096  # nothing of the input echoed back


def _serves(client: httpx.Client) -> None:
    r = client.post(C, json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("name, path, body, status, code", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_is_refused_and_the_server_serves_on(edge_server, name, path, body, status, code):
    with httpx.Client(base_url=edge_server.url, timeout=60,
                      headers={**edge_server.headers, "Content-Type": "application/json"}) as client:
        _openai_error(client.post(path, content=body), status, code)
        _serves(client)


def test_64_kb_of_headers_is_refused_and_the_server_serves_on(edge_server):
    port = int(edge_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536
                  + b"\r\nContent-Length: 2\r\n\r\n{}")
        s.shutdown(socket.SHUT_WR)
        response = b""
        while chunk := s.recv(4096):
            response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.split()[1] == b"400", head
    assert json.loads(body)["error"]["code"] == "request_headers_too_large"
    with httpx.Client(base_url=edge_server.url, timeout=60, headers=edge_server.headers) as client:
        _serves(client)


def test_the_count_limits_leave_room_for_what_fits(edge_server):
    """Just under the bounds, a request still gets through to the context check or the answer."""
    with httpx.Client(base_url=edge_server.url, timeout=60, headers=edge_server.headers) as client:
        r = client.post(C, json={"model": MODEL, "prompt": [1] * (MAX_MODEL_LEN - 4), "max_tokens": 2})
        assert r.status_code == 200, r.text[:300]
        r = client.post(C, json={"model": "n" * 1024, "prompt": "Hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
