"""CPU threads for torch and the native kernels: how many, and how they wait.

Both run their parallel loops on one OpenMP runtime (libgomp). By default libgomp's threads
spin-wait, at a barrier or between two parallel regions, for up to 300,000 iterations before
they sleep. On cores of their own that is the fastest; on cores that another process also
wants, a thread that spins holds a core the thread it waits for needs, and every parallel
region can wait out a time slice of the scheduler. A *passive* wait sleeps at once and gives the
core back, but costs a wake-up at every parallel region when the cores are free. Measured on a
2-core AMD EPYC (Zen 4), the Qwen2.5-Coder-1.5B on its Q4_K_M blocks, 128 tokens, tokens/s of two
runs: quiet, spinning 25.2 and 27.5, passive 15.2 and 21.1; beside one CPU-bound process,
spinning 9.3 and 7.3, passive 18.1 and 19.4 (spin counts of 3,000 and 30,000 were worse than
either where it mattered).

So the policy is chosen when quickdraft loads, from the 1-minute load average (``busy``): passive
where other work already keeps half the usable cores busy, libgomp's spinning otherwise. A user's
own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` always wins.

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


def busy(load: float | None = None, cpus: int | None = None) -> bool:
    """Whether other work keeps this machine's cores busy already: a 1-minute load average of at
    least half the cores this process may use (and at least 1)."""
    try:
        load = os.getloadavg()[0] if load is None else load
    except OSError:  # no load average on this OS
        return False
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return load >= max(1.0, cpus / 2)


@contextlib.contextmanager
def passive_waits():
    """Within: OpenMP threads are made to wait passively when the runtime loads (import torch
    here) if the cores are ``busy``, unless the user chose a policy or it is loaded already (then
    it is too late). The variable is set only meanwhile, so child processes (a peer server the
    bench starts, built with OpenMP too) keep their own default."""
    chosen = "torch" in sys.modules or any(v in os.environ for v in WAIT_VARIABLES) or not busy()
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
