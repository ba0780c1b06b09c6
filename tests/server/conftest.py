"""Servers for the tests (see qd_server.py). Session-scoped: each configuration starts once (a few
seconds: the weights come from the conversion cache) and is terminated at the end of the session.
"""

from __future__ import annotations

import openai
import pytest
from qd_server import API_KEY, EDGE_MAX_BODY, ServerProcess


def _serve(request, *extra, **kw) -> ServerProcess:
    server = ServerProcess(*extra, **kw)
    request.addfinalizer(server.stop)
    return server.wait_ready()


@pytest.fixture(scope="session")
def plain_server(request, smollm2_path) -> ServerProcess:
    """No speculation, 8 slots."""
    return _serve(request, "--max-num-seqs", "8", log_name="plain")


@pytest.fixture(scope="session")
def ngram_server(request, smollm2_path) -> ServerProcess:
    """ngram K=4, speculating at every batch size (so that batching meets speculation)."""
    return _serve(request, "--max-num-seqs", "8", "--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}', "--speculative-disable-by-batch-size", "0",
                  log_name="ngram")


@pytest.fixture(scope="session")
def adaptive_server(request, smollm2_path) -> ServerProcess:
    """ngram up to K=4 with the default adaptive plan: which drafts are verified depends on timing."""
    return _serve(request, "--max-num-seqs", "8", "--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 4}', log_name="adaptive")


@pytest.fixture(scope="session")
def edge_server(request, smollm2_path) -> ServerProcess:
    """No speculation, a body limit of EDGE_MAX_BODY bytes: for hostile input and fuzzing."""
    return _serve(request, "--max-num-seqs", "4", "--max-body-bytes", str(EDGE_MAX_BODY), log_name="edge")


@pytest.fixture(scope="session")
def small_server(request, smollm2_path) -> ServerProcess:
    """One slot and a queue of one: for queue-full, disconnect and draining tests."""
    return _serve(request, "--max-num-seqs", "1", "--max-queue", "1", log_name="small")


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(ngram_server):
    """The real openai client against a speculating (ngram) server."""
    return _client(ngram_server)


@pytest.fixture(scope="module")
def plain_client(plain_server):
    """The same model served without speculation: what a speculating server must answer too."""
    return _client(plain_server)

