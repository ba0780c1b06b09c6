"""A bounded load test on loopback: 32 requests over 8 concurrent streams, mixed greedy and sampled,
chat and completions, streaming and not, against a plain server, an ngram server with a fixed K
and one with the default adaptive K.

Every request completes; every greedy output equals what the offline ``LLM.generate`` gives for the
same prompt, token for token (float32; batching and speculation change nothing but speed); the
deltas of the Prometheus counters equal the sums of the responses' ``usage``.
"""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
import torch
from qd_server import API_KEY, MAX_MODEL_LEN, MODEL

from quickdraft import LLM, SamplingParams
from quickdraft.models.loader import load_model

pytestmark = pytest.mark.slow

NUM_REQUESTS, CONCURRENCY = 32, 8
TEXTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Here is a list of fruits: apple, banana,",
    "Once upon a time, in a small village,",
    "import numpy as np\n\ndef mean(xs):",
    "Q: What is 12 + 30?\nA:",
    "The quick brown fox",
    "To make a cup of tea, first",
]
CHATS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is Python?"}],
    [{"role": "user", "content": "Count from 1 to 10."}],
    [{"role": "user", "content": "Give me two synonyms of fast."}],
]


def _plan() -> list[dict]:
    """32 request specs: every 3rd a chat, every 2nd greedy, half of them streaming."""
    plan = []
    for i in range(NUM_REQUESTS):
        chat = i % 3 == 0
        plan.append({
            "i": i, "chat": chat, "greedy": i % 2 == 0, "stream": i % 4 in (1, 2),
            "prompt": CHATS[i % len(CHATS)] if chat else TEXTS[i % len(TEXTS)],
            "max_tokens": (12, 20, 28)[i % 3],
        })
    return plan


@pytest.fixture(scope="module")
def offline():
    """Greedy reference outputs from LLM.generate, in one batch (the decoder is batch invariant)."""
    model = load_model(MODEL, torch.float32)
    llm = LLM(model, dtype="float32", max_num_seqs=16, max_model_len=MAX_MODEL_LEN)
    greedy = [p for p in _plan() if p["greedy"]]
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(p["prompt"], add_generation_prompt=True)) if p["chat"]
               else tok.encode(p["prompt"]) for p in greedy]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=p["max_tokens"], temperature=0) for p in greedy])
    return {p["i"]: o for p, o in zip(greedy, outs)}


async def _one(client: openai.AsyncOpenAI, p: dict) -> dict:
    kw = dict(model=MODEL, max_tokens=p["max_tokens"], extra_body={"return_token_ids": True})
    if p["greedy"]:
        kw["temperature"] = 0
    else:
        kw.update(temperature=0.9, top_p=0.95, seed=1000 + p["i"])
        kw["extra_body"]["top_k"] = 40
    create = client.chat.completions.create if p["chat"] else client.completions.create
    kw["messages" if p["chat"] else "prompt"] = p["prompt"]
    if not p["stream"]:
        r = await create(**kw)
        c = r.choices[0]
        text = c.message.content if p["chat"] else c.text
        return {"text": text, "ids": c.model_extra["token_ids"], "finish": c.finish_reason, "usage": r.usage}
    stream = await create(**kw, stream=True, stream_options={"include_usage": True})
    text, ids, finish, usage = "", [], None, None
    async for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text += (c.delta.content or "") if p["chat"] else c.text
            ids += c.model_extra.get("token_ids") or []
            finish = c.finish_reason or finish
    return {"text": text, "ids": ids, "finish": finish, "usage": usage}


async def _run_all(url: str) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def limited(p):
        async with gate:
            return await _one(client, p)

    try:
        return await asyncio.gather(*(limited(p) for p in _plan()))
    finally:
        await client.close()


def _counter(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.parametrize("server_name", ["plain_server", "ngram_server", "adaptive_server"])
def test_load(request, server_name, offline):
    server = request.getfixturevalue(server_name)
    before = server.metrics()
    t0 = time.monotonic()
    results = asyncio.run(_run_all(server.url))
    elapsed = time.monotonic() - t0
    after = server.metrics()
    plan = _plan()

    assert len(results) == NUM_REQUESTS
    for p, r in zip(plan, results):
        assert r["finish"] in ("stop", "length"), (p, r)
        # no stop strings here: a "stop" is the end of sequence, which usage counts (vLLM's rule)
        assert r["usage"].completion_tokens == len(r["ids"]) + (r["finish"] == "stop") <= p["max_tokens"]
        if p["greedy"]:
            ref = offline[p["i"]]
            assert r["ids"] == ref.token_ids, f"request {p['i']} differs from LLM.generate"
            assert r["text"] == ref.text and r["finish"] == ref.finish_reason

    def delta(name, **labels):
        return _counter(after, name, **labels) - _counter(before, name, **labels)

    usages = [r["usage"] for r in results]
    specs = [u.model_extra["speculative"] for u in usages]
    assert delta("quickdraft:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("quickdraft:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("quickdraft:spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in specs)
    assert delta("quickdraft:spec_decode_num_accepted_tokens_total") == sum(s["num_accepted_tokens"] for s in specs)
    assert delta("quickdraft:spec_decode_num_drafts_total") == sum(s["num_drafts"] for s in specs)
    finished = {reason: sum(r["finish"] == reason for r in results) for reason in ("stop", "length")}
    for reason, n in finished.items():
        assert delta("quickdraft:request_success_total", finished_reason=reason) == n
    assert delta("quickdraft:e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert after[("quickdraft:num_requests_running", ())] == 0
    if server_name == "ngram_server":
        assert sum(s["num_draft_tokens"] for s in specs) > 0
        assert sum(s["num_accepted_tokens"] for s in specs) > 0
        per_pos = sum(delta("quickdraft:spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
                      for j in range(4))
        assert per_pos == sum(s["num_accepted_tokens"] for s in specs)
    elif server_name == "plain_server":
        assert all(s["num_draft_tokens"] == 0 for s in specs)
    print(f"{server_name}: {NUM_REQUESTS} requests, {sum(u.completion_tokens for u in usages)} tokens in {elapsed:.1f}s")
