"""Hostile input against the real server: each request as sent, its status and OpenAI's error
body. The body limit, the JSON depth limit, lone surrogates, prompts refused before tokenizing,
and ``max_tokens`` against the context (vLLM's rule), streamed or not."""

from __future__ import annotations

import http.client
import json
import socket

import httpx
import pytest
from qd_server import EDGE_MAX_BODY, MAX_MODEL_LEN, MODEL

pytestmark = pytest.mark.slow

C, CHAT = "/v1/completions", "/v1/chat/completions"
DEEP = b"[" * 10_000 + b"]" * 10_000
FIVE_MB = "x " * 2_500_000


def _raw(body: str) -> bytes:
    return body.encode()


# (id, path, body (dict, or raw bytes), status, message fragment, param, code)
CASES = [
    ("deep-body", C, DEEP, 400, "nests arrays and objects 10000 levels deep; at most 64", None, "json_too_deep"),
    ("deep-in-a-field", CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": %s}]}' % (MODEL.encode(), DEEP),
     400, "10003 levels deep", None, "json_too_deep"),
    ("deep-in-a-string-is-text", C, _raw('{"model": "%s", "prompt": "%s", "max_tokens": 1}' % (MODEL, "[" * 100)),
     200, None, None, None),
    ("surrogate-chat-content", CHAT, _raw('{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL),
     400, "messages.0.content: the string holds a lone UTF-16 surrogate", "messages.0.content", "invalid_unicode"),
    ("surrogate-prompt-list", C, _raw('{"model": "%s", "prompt": ["ok", "a\\udfffb"]}' % MODEL), 400,
     "lone UTF-16 surrogate", "prompt.1", "invalid_unicode"),
    ("surrogate-stop", C, _raw('{"model": "%s", "prompt": "Hi", "stop": "\\uDBFF"}' % MODEL), 400,
     "lone UTF-16 surrogate", "stop", "invalid_unicode"),
    ("surrogate-key", C, _raw('{"model": "%s", "prompt": "Hi", "\\ud800": 1}' % MODEL), 400,
     "lone UTF-16 surrogate", "\\ud800", "invalid_unicode"),
    ("surrogate-pair-is-fine", C, _raw('{"model": "%s", "prompt": "\\ud83d\\ude00", "max_tokens": 1}' % MODEL),
     200, None, None, None),
    ("five-mb-prompt", C, {"model": MODEL, "prompt": FIVE_MB, "max_tokens": 1}, 400,
     "the prompt has at least", "prompt", "context_length_exceeded"),
    ("five-mb-chat", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": FIVE_MB}]}, 400,
     "the prompt has at least", "messages", "context_length_exceeded"),
    ("five-mb-tokenize", "/tokenize", {"model": MODEL, "prompt": FIVE_MB}, 400,
     "the prompt has at least", "prompt", "context_length_exceeded"),  # refused from its bytes, as a prompt is
    ("five-mb-tokenize-without-model", "/tokenize", {"prompt": FIVE_MB, "add_special_tokens": False}, 400,
     "the prompt has at least", "prompt", "context_length_exceeded"),
    ("tokenize-past-the-context-that-may-fit", "/tokenize", {"model": MODEL, "prompt": "x " * MAX_MODEL_LEN},
     200, None, None, None),  # counted exactly: a client may window a long text (see test_tokenize_counts_past_the_context)
    ("top-p-below-float32", CHAT, {"model": MODEL, "messages": [{"role": "tool"}], "top_p": 5e-324, "max_tokens": 4},
     200, None, None, None),  # found by test_fuzz: float32 rounds it to 0, which once emptied the nucleus
    ("many-prompts", C, {"model": MODEL, "prompt": ["x " * 1000] * 1000}, 400,
     "1000 choices exceed what this server can ever hold", "n", 400),  # refused before tokenizing them
    ("max-tokens-0-without-echo", C, {"model": MODEL, "prompt": "Hi", "max_tokens": 0}, 400,
     "max_tokens must be at least 1, or 0 with echo", "max_tokens", 400),
]
for stream in (False, True):
    s = "-stream" if stream else ""
    CASES += [
        (f"max-tokens-1e12{s}", C, {"model": MODEL, "prompt": "Hi", "max_tokens": 10**12, "stream": stream}, 400,
         "you requested 1000000000001 tokens (1 in the prompt, 1000000000000 in the completion)", "max_tokens",
         "context_length_exceeded"),
        (f"max-tokens-2e70{s}", C, {"model": MODEL, "prompt": "Hi", "max_tokens": 2**70, "stream": stream}, 400,
         f"{2**70} in the completion", "max_tokens", "context_length_exceeded"),
        (f"chat-max-tokens-1e12{s}", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
         "max_tokens": 10**12, "stream": stream}, 400, "in the messages, 1000000000000 in the completion",
         "max_tokens", "context_length_exceeded"),
        (f"chat-max-completion-tokens-2e70{s}", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
         "max_completion_tokens": 2**70, "stream": stream}, 400, f"{2**70} in the completion",
         "max_completion_tokens", "context_length_exceeded"),
        (f"prompt-plus-max-tokens-one-over{s}", C, {"model": MODEL, "prompt": [17] * (MAX_MODEL_LEN - 3),
         "max_tokens": 4, "stream": stream}, 400, f"you requested {MAX_MODEL_LEN + 1} tokens", "max_tokens",
         "context_length_exceeded"),
        (f"prompt-plus-max-tokens-exactly{s}", C, {"model": MODEL, "prompt": [17] * (MAX_MODEL_LEN - 4),
         "max_tokens": 4, "stream": stream}, 200, None, None, None),
    ]


def _error(r: httpx.Response, status: int, fragment: str, param, code) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code, err
    assert fragment in err["message"], err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_input(edge_server, case):
    _, path, body, status, fragment, param, code = case
    before = edge_server.metrics()
    kw = {"content": body, "headers": {**edge_server.headers, "Content-Type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body, "headers": edge_server.headers}
    r = httpx.post(edge_server.url + path, timeout=120, **kw)
    if status == 200:
        assert r.status_code == 200, r.text
        return
    _error(r, status, fragment, param, code)
    after = edge_server.metrics()
    key = ("quickdraft:request_failure_total", (("reason", "bad_request"),))
    assert after[key] == before[key] + 1
    # refused before any model work: not a token of the prompt was counted
    assert after[("quickdraft:prompt_tokens_total", ())] == before[("quickdraft:prompt_tokens_total", ())]


def test_tokenize_counts_past_the_context(edge_server):
    """A text that may fit is tokenized and counted exactly, past the context too: the bound
    refuses only what certainly cannot fit."""
    r = httpx.post(edge_server.url + "/tokenize", json={"model": MODEL, "prompt": "x " * MAX_MODEL_LEN},
                   headers=edge_server.headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["count"] > MAX_MODEL_LEN and r.json()["max_model_len"] == MAX_MODEL_LEN


def _send(server, headers: dict, chunks: list[bytes]) -> tuple[int, dict, str]:
    """A POST whose body goes out as given (chunked where no Content-Length is set); the reply is
    read without finishing the body, as a client that is cut off would see it."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.putrequest("POST", C)
    for k, v in {**server.headers, "Content-Type": "application/json", **headers}.items():
        conn.putheader(k, v)
    conn.endheaders()
    for chunk in chunks:
        conn.send(chunk)
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read().decode()
    conn.close()
    return out


def _too_large(status, text) -> str:
    assert status == 413, text
    err = json.loads(text)["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert f"bytes; this server takes at most {EDGE_MAX_BODY} (--max-body-bytes)" in err["message"], err
    return err["message"]


def test_declared_body_over_the_limit_is_refused_unread(edge_server):
    """Content-Length over --max-body-bytes: a 413 before a byte of the body is read."""
    status, _, text = _send(edge_server, {"Content-Length": str(EDGE_MAX_BODY + 1)}, [])
    assert f"at least {EDGE_MAX_BODY + 1} bytes" in _too_large(status, text)


def test_chunked_body_over_the_limit_is_refused_once_read_past_it(edge_server):
    """No Content-Length (chunked): the 413 comes once the chunks read pass the limit; the
    client never sends the body's end."""
    def chunk(n: int) -> bytes:
        return b"%x\r\n%s\r\n" % (n, b" " * n)

    status, _, text = _send(edge_server, {"Transfer-Encoding": "chunked"},
                            [chunk(1_000_000)] * (EDGE_MAX_BODY // 1_000_000) + [chunk(1000)])
    _too_large(status, text)  # how far it read past the limit depends on how the socket split the body


def test_body_at_the_limit_is_read(edge_server):
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode()
    body += b" " * (EDGE_MAX_BODY - len(body))
    r = httpx.post(edge_server.url + C, content=body, headers={**edge_server.headers, "Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 200, r.text


def test_server_healthy_after_hostile_input(edge_server):
    assert edge_server.health()["status"] == "ok"
    assert "Exception in ASGI application" not in edge_server.log() and "Traceback" not in edge_server.log()


@pytest.mark.parametrize("head", [
    b"X-A: a\rb\r\nContent-Length: 2\r\n",  # a bare CR in a header
    b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n",  # CL + TE, a smuggling attempt
    b"Content-Length: 2\r\nContent-Length: 3\r\n",  # conflicting lengths
], ids=["bare-cr", "cl-te", "two-lengths"])
def test_malformed_http_gets_uvicorns_plain_400(edge_server, head):
    """Malformed HTTP never reaches the app: uvicorn answers a plain-text 400 and closes the
    connection (docs/serving-errors.md says so)."""
    with socket.create_connection(("127.0.0.1", edge_server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n{}")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400 ") and b"content-type: text/plain" in reply.lower()
    assert reply.endswith(b"\r\n\r\nInvalid HTTP request received.")
