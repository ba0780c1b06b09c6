"""Memory after hostile input: the server's RSS after 1,000 refused requests stays within
RSS_BOUND of its RSS before them (measured after one warm-up round of each kind, so that first-use
allocations, such as the JSON and tokenizer buffers, are in both figures)."""

from __future__ import annotations

import itertools

import httpx
import psutil
import pytest
from qd_server import MODEL

pytestmark = pytest.mark.slow

RSS_BOUND = 64 * 2**20  # generous: the figure measured is in docs/serving-errors.md
BAD = 1000
C, CHAT = "/v1/completions", "/v1/chat/completions"
KINDS = [  # (path, raw body, status)
    (C, b"[" * 10_000 + b"]" * 10_000, 400),
    (CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": %s}]}' % (MODEL.encode(), b"[" * 5000 + b"]" * 5000), 400),
    (CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL.encode(), 400),
    (C, b'{"model": "%s", "prompt": "%s", "max_tokens": 1}' % (MODEL.encode(), b"x " * 500_000), 400),
    (C, b'{"model": "%s", "prompt": "Hi", "max_tokens": 1180591620717411303424, "stream": true}' % MODEL.encode(), 400),
    (C, b'{"model": "%s", "prompt": ' % MODEL.encode(), 400),
    (C, b'{"model": "%s", "prompt": "Hi", "max_tokenz": 3}' % MODEL.encode(), 400),
    (C, b'{"model": "gpt-5", "prompt": "Hi"}', 404),
    (C, b'\xff\xfe', 400),
]


def _rss(server) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


def test_rss_after_bad_requests(edge_server):
    with httpx.Client(base_url=edge_server.url, headers={**edge_server.headers, "Content-Type": "application/json"},
                      timeout=60) as client:
        def send(kind) -> None:
            path, body, status = kind
            r = client.post(path, content=body)
            assert r.status_code == status and "error" in r.json(), r.text[:300]

        for kind in KINDS:
            send(kind)
        before = _rss(edge_server)
        for kind in itertools.islice(itertools.cycle(KINDS), BAD):
            send(kind)
        after = _rss(edge_server)
        assert client.get("/health").json()["status"] == "ok"
    print(f"\nRSS before {before / 2**20:.1f} MiB, after {BAD} bad requests {after / 2**20:.1f} MiB "
          f"({(after - before) / 2**20:+.1f} MiB)")
    assert after - before < RSS_BOUND
