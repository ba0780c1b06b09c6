"""CPU threads for torch and the native kernels: how many, and how they wait.

Both run their parallel loops on one OpenMP runtime (libgomp). By default libgomp's threads
spin-wait, at a barrier or between two parallel regions, for up to 300,000 iterations before
they sleep. On cores that another process also wants, a thread that spins holds a core the
thread it waits for needs, and every parallel region can wait out a time slice of the
scheduler. A *passive* wait sleeps at once and gives the core back. Measured with SmolLM2-135M
(``quickdraft generate``, 48 tokens, 2 threads) on a 2-core AMD EPYC that other work kept busy
(load average 4 to 9), median of 3 runs: 7.9 tokens/s with libgomp's default waits, 54.6 with
passive ones; with one more CPU-bound process beside it, 4.6 against 84.8.

Terms: the *wait policy* is ``OMP_WAIT_POLICY`` (passive: sleep at once); libgomp reads it once,
when it is loaded (with ``import torch``), so ``passive_waits`` must be around that import. The
*thread count* is torch's intra-op threads (``torch.set_num_threads``), which the kernels' parallel
regions follow too (both ask the calling thread's OpenMP setting).
"""

from __future__ import annotations

import contextlib
import os
import sys

from quickdraft.errors import ConfigError

# the variables a user sets to choose libgomp's waits; any of them set leaves the choice to them
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@contextlib.contextmanager
def passive_waits():
    """Within: OpenMP threads are made to wait passively when the runtime loads (import torch
    here), unless the user chose a policy or it is loaded already (then it is too late). The
    variable is set only meanwhile, so child processes (a peer server the bench starts, built
    with OpenMP too) keep their own default."""
    chosen = "torch" in sys.modules or any(v in os.environ for v in WAIT_VARIABLES)
    if not chosen:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        if not chosen:
            os.environ.pop("OMP_WAIT_POLICY", None)


def set_threads(threads: int) -> None:
    """Run torch and the kernels on ``threads`` threads. Without a call they run on torch's
    default: one thread per physical core the process may run on (its CPU affinity), or
    ``$OMP_NUM_THREADS``."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"threads must be an integer >= 1, got {threads!r}", "threads")
    import torch

    torch.set_num_threads(threads)
