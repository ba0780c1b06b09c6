"""The gauges a load-aware router reads (llm-d's endpoint picker, the Gateway API inference
extension's model server protocol) under vLLM's names, beside quickdraft's own, parsed by
prometheus_client while one request decodes and one waits."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from qd_server import MODEL

pytestmark = pytest.mark.slow

LONG = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 300, "temperature": 0}
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:gpu_cache_usage_perc")


def _gauges(server) -> dict[str, tuple[dict, float]]:
    """{name: (labels, value)} of every gauge, as prometheus_client parses the page."""
    text = httpx.get(server.url + "/metrics", timeout=5).text
    return {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) if f.type == "gauge"
            for s in f.samples}


async def _until(server, timeout: float = 20.0, **want) -> dict:
    async with httpx.AsyncClient() as c:
        for _ in range(int(timeout / 0.05)):
            h = (await c.get(server.url + "/health")).json()
            if all(h[k] == v for k, v in want.items()):
                return h
            await asyncio.sleep(0.05)
    raise AssertionError(f"health never reached {want}: {h}")


def test_vllm_named_gauges_follow_the_scheduler(small_server):
    """small_server: one KV slot and a queue of one."""
    idle = _gauges(small_server)
    for name in VLLM_GAUGES:
        labels, value = idle[name]
        assert labels == {"model_name": MODEL, "engine": "0"} and value == 0, (name, labels, value)

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            tasks = [asyncio.create_task(c.post(small_server.url + "/v1/completions", json=LONG,
                                                headers=small_server.headers)) for _ in range(2)]
            await _until(small_server, running=1, waiting=1)
            busy = _gauges(small_server)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await _until(small_server, running=0, waiting=0, free_slots=1)
        return busy

    busy = asyncio.run(run())
    assert busy["vllm:num_requests_running"][1] == busy["quickdraft:num_requests_running"][1] == 1
    assert busy["vllm:num_requests_waiting"][1] == busy["quickdraft:num_requests_waiting"][1] == 1
    assert busy["vllm:kv_cache_usage_perc"][1] == busy["vllm:gpu_cache_usage_perc"][1] == 1.0  # the one slot
    after = _gauges(small_server)
    assert [after[n][1] for n in VLLM_GAUGES] == [0, 0, 0, 0]
