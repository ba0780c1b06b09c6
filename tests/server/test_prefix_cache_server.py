"""Prefix caching through the server, with the real openai client: a chat's second turn is served
mostly from the cache (``usage.prompt_tokens_details.cached_tokens``, the Prometheus hit counter),
and answers, sequential or concurrent with a shared system prompt, equal a server without it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from qd_server import API_KEY, MODEL, ServerProcess

pytestmark = pytest.mark.slow

SYSTEM = {"role": "system", "content": "You are a terse assistant for a hardware store. Answer in one sentence, "
                                       "name a tool, and never apologise."}


@pytest.fixture(scope="module")
def uncached_client(request, smollm2_path):
    server = ServerProcess("--max-num-seqs", "4", "--no-enable-prefix-caching", log_name="uncached")
    request.addfinalizer(server.stop)
    server.wait_ready()
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def two_turns(client, question: str):
    messages = [SYSTEM, {"role": "user", "content": question}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And a cheaper one?"}]
    return first, client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)


def hits(server) -> float:
    return server.metrics()[("quickdraft:prefix_cache_hits_total", ())]


def test_second_turn_is_served_from_the_cache(plain_server, plain_client, uncached_client):
    before = hits(plain_server)
    cached = two_turns(plain_client, "How do I loosen a rusted bolt?")
    uncached = two_turns(uncached_client, "How do I loosen a rusted bolt?")
    assert [r.choices[0].message.content for r in cached] == [r.choices[0].message.content for r in uncached]
    second = cached[1].usage
    assert second.prompt_tokens_details.cached_tokens > cached[0].usage.prompt_tokens // 2
    assert second.prompt_tokens_details.cached_tokens < second.prompt_tokens
    assert all(r.usage.prompt_tokens_details.cached_tokens == 0 for r in uncached)
    assert hits(plain_server) - before >= second.prompt_tokens_details.cached_tokens


def test_concurrent_requests_sharing_a_system_prompt(plain_client, uncached_client):
    questions = ["Which saw cuts metal?", "What glue holds wood?", "How do I drill tile?", "What fixes a leak?"]

    def ask(client, q):
        r = client.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": q}],
                                           max_tokens=8, temperature=0)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    ask(plain_client, "Hello?")  # a slot now holds the system prompt
    with ThreadPoolExecutor(4) as pool:
        cached = list(pool.map(lambda q: ask(plain_client, q), questions))
    uncached = [ask(uncached_client, q) for q in questions]
    assert [a for a, _ in cached] == [a for a, _ in uncached]
    assert any(n > 0 for _, n in cached)  # the system prompt, from a slot that held it already


def test_a_config_dict_turns_the_cache_off():
    """Ray Serve's builder and Triton's config.pbtxt pass the serve flags as a dict."""
    from quickdraft.server.cli import args_from_dict

    assert args_from_dict({"model": MODEL, "enable_prefix_caching": False}, "test").enable_prefix_caching is False
    assert args_from_dict({"model": MODEL, "enable-prefix-caching": "true"}, "test").enable_prefix_caching is True
    assert args_from_dict({"model": MODEL}, "test").enable_prefix_caching is True
