"""The cross-request part of method "suffix" through ``quickdraft serve`` and the real ``openai``
client: a second, similar request drafts from the first one's output (the server's global cache),
and a restarted server keeps what the first one learned (``suffix_decoding_cache_path``)."""

from __future__ import annotations

import json

import openai
import pytest
from qd_server import API_KEY, MODEL, ServerProcess

pytestmark = pytest.mark.slow

SPEC = {"method": "suffix", "num_speculative_tokens": 8, "adaptive": False}
ASK = dict(model=MODEL, max_tokens=48, temperature=0,
           messages=[{"role": "user", "content": "Write a Python function that returns the sum of the squares of a list."}])
EDIT = dict(ASK, messages=[{"role": "user", "content": "Write a Python function that returns the sum of the squares "
                                                       "of a list, and show an example."}])


def _spec(usage) -> dict:
    return usage.model_extra["speculative"] if usage.model_extra else usage.speculative


def _serve(cache_path=None) -> ServerProcess:
    spec = dict(SPEC, suffix_decoding_cache_path=str(cache_path)) if cache_path else SPEC
    server = ServerProcess("--max-num-seqs", "2", "--speculative-config", json.dumps(spec), log_name="suffix")
    try:
        return server.wait_ready()
    except BaseException:  # never leave a server running behind a failed start
        server.stop()
        raise


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_a_second_request_drafts_from_the_first_ones_output(tmp_path):
    cache = tmp_path / "suffix-cache.json"
    server = _serve(cache)
    try:
        client = _client(server)
        first = client.chat.completions.create(**ASK)
        again = client.chat.completions.create(**ASK)
        edited = client.chat.completions.create(**EDIT)
    finally:
        server.stop()  # SIGTERM: the drained server saves its cache
    a, b, c = (_spec(r.usage) for r in (first, again, edited))
    assert again.choices[0].message.content == first.choices[0].message.content
    assert a["method"] == "suffix"
    # the repeated request drafts the first answer back from its first tokens on
    assert b["mean_accepted_length"] > a["mean_accepted_length"] + 1.0
    assert b["acceptance_rate"] > a["acceptance_rate"]
    # a similar request: where its answer follows the first one, it drafts from it
    assert c["mean_accepted_length"] > a["mean_accepted_length"]
    saved = json.loads(cache.read_text())
    assert len(saved["outputs"]) == 3

    restarted = _serve(cache)  # a new process: only the file carries what the first one learned
    try:
        after = _client(restarted).chat.completions.create(**ASK)
    finally:
        restarted.stop()
    assert after.choices[0].message.content == first.choices[0].message.content
    assert _spec(after.usage)["mean_accepted_length"] > a["mean_accepted_length"] + 1.0
