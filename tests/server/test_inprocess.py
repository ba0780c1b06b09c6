"""The app in this process (httpx's ASGI transport), with a fault injected into the engine: a request
whose logits turn non-finite fails alone with a 500 (or, mid-stream, an error event), and the
request beside it runs on to the same tokens it gets alone."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from qd_server import MODEL

from quickdraft.config import EngineConfig
from quickdraft.engine.engine import Engine
from quickdraft.models.loader import LoadedModel, load_model
from quickdraft.models.tiny import random_weights, tiny_config
from quickdraft.sampling import SamplingParams
from quickdraft.server.app import ServerSettings, build_app
from quickdraft.server.async_engine import AsyncEngine
from quickdraft.server.metrics import ServerMetrics

pytestmark = pytest.mark.slow

POISON_AT_PROMPT = [5, 5, 5, 7, 100, 200, 300]  # NaN logits on the prompt pass
POISON_MIDWAY = [5, 5, 5, 8, 100, 200, 300]  # NaN logits once 3 tokens are out
NORMAL = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


def _poisoned(seq) -> bool:
    head = seq.prompt_token_ids[:4]
    return head == POISON_AT_PROMPT[:4] or (head == POISON_MIDWAY[:4] and len(seq.output_token_ids) >= 3)


@pytest.fixture(scope="module")
def app(smollm2_path):
    engine = Engine(EngineConfig(model=MODEL, dtype="float32", max_num_seqs=4, max_model_len=256),
                    target=load_model(MODEL, torch.float32))
    forward = engine.runner._forward

    def poisoned_forward(seqs, batch):
        logits = forward(seqs, batch)  # [num_draft_tokens + batch, V], an inference tensor as in real runs
        start = 0
        for s, k in zip(seqs, batch.proposal.num_tokens):
            if _poisoned(s):
                with torch.inference_mode():
                    logits[start : start + k + 1] = float("nan")
            start += k + 1
        return logits

    engine.runner._forward = poisoned_forward
    metrics = ServerMetrics(MODEL)
    return build_app(AsyncEngine(engine, metrics), ServerSettings(served_model_names=[MODEL])), engine


async def _with_client(app, fn):
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            return await fn(c)


def test_nan_fails_one_request_only(app):
    app, engine = app

    async def fn(c):
        alone = (await c.post("/v1/completions", json=NORMAL)).json()["choices"][0]["text"]
        bad = {**NORMAL, "prompt": POISON_AT_PROMPT}
        normal, failed = await asyncio.gather(c.post("/v1/completions", json=NORMAL),
                                              c.post("/v1/completions", json=bad))
        stream_bad = await c.post("/v1/completions", json={**NORMAL, "prompt": POISON_MIDWAY, "stream": True})
        health = (await c.get("/health")).json()
        metrics = (await c.get("/metrics")).text
        return alone, normal, failed, stream_bad, health, metrics

    alone, normal, failed, stream_bad, health, metrics = asyncio.run(_with_client(app, fn))
    assert normal.status_code == 200 and normal.json()["choices"][0]["text"] == alone
    assert failed.status_code == 500
    err = failed.json()["error"]
    assert err["type"] == "internal_error" and "non-finite" in err["message"]
    # mid-stream: the 200 has gone out, so the failure is an error event after some text
    assert stream_bad.status_code == 200
    events = [json.loads(line[6:]) for line in stream_bad.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert any(e.get("choices") and e["choices"][0]["text"] for e in events[:-1])
    assert "non-finite" in events[-1]["error"]["message"] and events[-1]["error"]["code"] == 500
    assert health["free_slots"] == 4 and health["running"] == 0
    assert 'quickdraft:request_failure_total{model_name="smollm2-135m-instruct",reason="error"} 2.0' in metrics


def test_engine_nan_fails_only_that_sequence():
    """The engine alone, a tiny random model: NaN logits in one row of the batch end that sequence
    with finish_reason "error" and leave its neighbour's tokens as they are alone."""
    config = tiny_config("llama", vocab_size=64, hidden_size=32, num_layers=1)
    tiny = LoadedModel(config, random_weights(config, seed=0), None, "tiny")
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def engine(poison: bool) -> Engine:
        e = Engine(EngineConfig(model="tiny", dtype="float32", max_num_seqs=2), target=tiny)
        logits = e.decoder.logits

        def nan_first_row(hidden):
            out = logits(hidden)
            if poison and out.shape[0] == 2:  # the first sequence's row, while both run
                with torch.inference_mode():
                    out[0] = float("nan")
            return out

        e.decoder.logits = nan_first_row
        return e

    alone = engine(False).generate_ids([[4, 5, 6]], [p])[0].token_ids
    outs = engine(True).generate_ids([[1, 2, 3], [4, 5, 6]], [p, p])
    assert outs[0].finish_reason == "error" and "non-finite" in outs[0].error and outs[0].token_ids == []
    assert outs[1].finish_reason == "length" and outs[1].token_ids == alone


def test_unexpected_errors_become_a_500_with_a_request_id(app, monkeypatch, caplog):
    """A bug (here: the tokenizer raising) never reaches the ASGI server (httpx's ASGI transport
    would raise it): the client gets OpenAI's error body naming a request id, sent too as
    X-Request-Id, and the log has the traceback once under that id. In a stream that has started,
    the error is the last event."""
    app, engine = app
    tokenizer = engine.tokenizer

    def broken(text):
        raise RuntimeError("tokenizer exploded")

    async def fn(c):
        with monkeypatch.context() as m:
            m.setattr(tokenizer, "encode", broken)
            plain = await c.post("/v1/completions", json={**NORMAL, "prompt": "Hi"})
        with monkeypatch.context() as m:
            m.setattr("quickdraft.server.app.IncrementalText.delta", lambda *a: 1 / 0)
            stream = await c.post("/v1/completions", json={**NORMAL, "stream": True})
        after = await c.post("/v1/completions", json=NORMAL)
        return plain, stream, after, (await c.get("/health")).json()

    with caplog.at_level("ERROR", logger="quickdraft.server"):
        plain, stream, after, health = asyncio.run(_with_client(app, fn))
    assert plain.status_code == 500
    err = plain.json()["error"]
    rid = plain.headers["x-request-id"]
    assert err == {"message": f"internal error (request id {rid}): RuntimeError: tokenizer exploded",
                   "type": "internal_error", "param": None, "code": 500}
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: ")]
    assert stream.status_code == 200 and events[-1]["error"]["type"] == "internal_error"
    assert "ZeroDivisionError" in events[-1]["error"]["message"] and "data: [DONE]" not in stream.text
    stream_rid = events[-1]["error"]["message"].split("request id ")[1].split(")")[0]
    logged = [r for r in caplog.records if r.exc_info]
    assert [(r.getMessage().count(rid), r.getMessage().count(stream_rid)) for r in logged] == [(1, 0), (0, 1)]
    assert after.status_code == 200 and health["running"] == 0 and health["free_slots"] == 4
