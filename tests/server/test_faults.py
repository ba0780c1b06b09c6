"""Overload and faults against a separate server process: a full queue answers 429 with
Retry-After; a client that disconnects (streaming or not) frees its KV slot at once; SIGTERM lets
the requests in flight finish while new ones get a 503, and exits 0."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
from qd_server import MODEL, ServerProcess

pytestmark = pytest.mark.slow

# Greedy counting: SmolLM2 keeps counting for hundreds of tokens, so these requests are still
# running when the test acts on them (no ignore_eos needed).
LONG = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 300, "temperature": 0}


def _failures(server, reason: str) -> float:
    return server.metrics()[("quickdraft:request_failure_total", (("reason", reason),))]


async def _wait_health(server, timeout: float = 20.0, **want) -> dict:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as c:
        while True:
            h = (await c.get(server.url + "/health")).json()
            if all(h[k] == v for k, v in want.items()):
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"health never reached {want}: {h}")
            await asyncio.sleep(0.05)


async def _data_events(lines, count: int) -> list[dict]:
    """The next ``count`` events from ``lines`` (a response's ``aiter_lines()``, kept by the caller:
    an abandoned line iterator closes the connection when it is collected)."""
    events = []
    while len(events) < count:
        line = await lines.__anext__()
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def test_queue_full_429_with_retry_after(small_server):
    async def run():
        before = _failures(small_server, "queue_full")
        h = small_server.headers
        async with httpx.AsyncClient(timeout=60) as a, httpx.AsyncClient(timeout=60) as b, \
                httpx.AsyncClient(timeout=60) as c:
            async with a.stream("POST", small_server.url + "/v1/completions", json={**LONG, "stream": True},
                                headers=h) as ra:
                a_lines = ra.aiter_lines()
                await _data_events(a_lines, 1)  # A holds the only slot
                waiting = asyncio.create_task(b.post(small_server.url + "/v1/completions", json=LONG, headers=h))
                await _wait_health(small_server, running=1, waiting=1)  # B fills the queue of one
                rc = await c.post(small_server.url + "/v1/completions", json=LONG, headers=h)
                assert rc.status_code == 429, rc.text
                assert int(rc.headers["retry-after"]) >= 1
                err = rc.json()["error"]
                assert err["type"] == "rate_limit_error" and "queue is full" in err["message"]
                waiting.cancel()  # B's client leaves too
        await _wait_health(small_server, running=0, waiting=0, free_slots=1)
        assert _failures(small_server, "queue_full") == before + 1

    asyncio.run(run())


def test_stream_disconnect_frees_slot(small_server):
    async def run():
        before = _failures(small_server, "abort")
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", small_server.url + "/v1/completions", json={**LONG, "stream": True},
                                headers=small_server.headers) as r:
                lines = r.aiter_lines()
                events = await _data_events(lines, 3)
                assert all(e["choices"][0]["finish_reason"] is None for e in events)
                h = (await c.get(small_server.url + "/health")).json()
                assert h["running"] == 1 and h["free_slots"] == 0
            # leaving the block closes the connection mid-stream
            t0 = time.monotonic()
            await _wait_health(small_server, running=0, free_slots=1, timeout=10)
            freed_after = time.monotonic() - t0
        assert _failures(small_server, "abort") == before + 1
        return freed_after

    freed_after = asyncio.run(run())
    assert freed_after < 5, freed_after
    # the slot is usable again
    r = httpx.post(small_server.url + "/v1/completions", json={**LONG, "max_tokens": 3},
                   headers=small_server.headers, timeout=60)
    assert r.status_code == 200


def test_nonstream_disconnect_frees_slot(small_server):
    async def run():
        before = _failures(small_server, "abort")
        async with httpx.AsyncClient(timeout=60) as c:
            task = asyncio.create_task(c.post(small_server.url + "/v1/completions", json=LONG,
                                              headers=small_server.headers))
            await _wait_health(small_server, running=1, free_slots=0)
            task.cancel()  # the client gives up: httpx closes the connection
            try:
                await task
            except asyncio.CancelledError:
                pass
        await _wait_health(small_server, running=0, free_slots=1, timeout=10)
        assert _failures(small_server, "abort") == before + 1

    asyncio.run(run())


def test_sigterm_drains_in_flight_then_exits_0():
    """What Kubernetes needs within terminationGracePeriodSeconds: after SIGTERM, /health and new
    requests get a 503 (OpenAI's format, Retry-After) so that the pod leaves the Service, while the
    requests in flight (running and queued) run to their end; then the socket closes, exit 0."""
    server = ServerProcess("--max-num-seqs", "2", log_name="sigterm")
    try:
        server.wait_ready()
        req = {**LONG, "max_tokens": 24, "stream": True}

        async def stream_one(c, out: list):
            async with c.stream("POST", server.url + "/v1/completions", json=req, headers=server.headers) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        out.append(line[6:])

        async def run():
            outs = [[], [], []]
            async with httpx.AsyncClient(timeout=120) as c:
                tasks = [asyncio.create_task(stream_one(c, o)) for o in outs]
                await _wait_health(server, running=2, waiting=1)  # two decoding, one queued
                server.proc.send_signal(15)
                async with httpx.AsyncClient(timeout=10) as fresh:  # a new connection: still accepted
                    deadline = time.monotonic() + 10
                    while (h := await fresh.get(server.url + "/health")).status_code == 200:
                        assert time.monotonic() < deadline, "still healthy after SIGTERM"
                        await asyncio.sleep(0.02)
                    assert h.status_code == 503 and h.json()["status"] == "draining"
                    late = await fresh.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 2},
                                            headers=server.headers)
                still_running = not all(t.done() for t in tasks)
                await asyncio.gather(*tasks)
            return outs, late, still_running

        outs, late, still_running = asyncio.run(run())
        assert still_running  # the 503s above came while the requests in flight ran on
        assert late.status_code == 503 and late.headers["retry-after"]
        assert late.json()["error"]["type"] == "service_unavailable"
        for lines in outs:
            assert lines[-1] == "[DONE]"
            last = json.loads(lines[-2])
            assert last["choices"][0]["finish_reason"] in ("stop", "length")
            text = "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1])
            assert text.strip()
        assert server.proc.wait(60) == 0, server.log()
        assert "Traceback" not in server.log()
        with pytest.raises(httpx.TransportError):  # drained and gone: the socket is closed
            httpx.get(server.url + "/health", timeout=2)
    finally:
        server.stop()


def test_a_port_in_use_is_a_clear_error_and_a_failing_exit():
    """The HTTP thread cannot bind: the engine loop on the main thread stops too, status 1."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        p = subprocess.run([sys.executable, "-m", "quickdraft", "serve", "--model", MODEL, "--dtype", "float32",
                            "--max-model-len", "256", "--port", str(busy.getsockname()[1])],
                           capture_output=True, text=True, timeout=180)
    assert p.returncode == 1
    assert "address already in use" in p.stderr
