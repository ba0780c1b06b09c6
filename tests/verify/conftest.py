"""Fixtures for the verifier tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """These tests run many small tensor ops; on a shared, busy CPU torch's spinning worker threads
    made them several times slower (56 s vs 8 s on 2 loaded cores). One thread, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
