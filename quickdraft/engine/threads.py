"""CPU threads for torch and the native kernels: how many, and how they wait.

Both run their parallel loops on one OpenMP runtime (libgomp). By default libgomp's threads
spin-wait, at a barrier or between two parallel regions, for up to 300,000 iterations before
they sleep. On cores of their own that is the fastest; on cores that another process also
wants, a thread that spins holds a core the thread it waits for needs, and every parallel
region can wait out a time slice of the scheduler. A *passive* wait sleeps at once and gives the
core back, but costs a wake-up at every parallel region when the cores are free. Measured on a
2-core AMD EPYC (Zen 4), the Qwen2.5-Coder-1.5B on its Q4_K_M blocks, 128 tokens, tokens/s of two
runs: quiet, spinning 25.2 and 27.5, passive 15.2 and 21.1; beside one CPU-bound process,
spinning 9.3 and 7.3, passive 18.1 and 19.4, on a fixed 2 threads (spin counts of 3,000 and 30,000
were worse than either where it mattered).

libgomp reads its policy once, when it loads, and so cannot follow the machine; the thread count
can change at any time. So quickdraft leaves libgomp's spinning as it is and follows the other
processes with the count: ``ThreadGovernor``, every half second while the engine runs, reads how
much of the machine's CPU time went to other processes (/proc/stat, models/pass_cost.py's
``others_share``) and runs the passes on the cores they leave free, at least one, back up to the
start's count when they go. On the cores left free a thread has no one to wait for, so spinning
costs nothing there: measured on a 2-core AMD EPYC Zen 4, the 1.5B, 2 x 128 tokens, three runs
each, interleaved (2026-12-07): quiet, spinning 31.3, 33.8, 33.0 tok/s and passive 26.4, 27.5,
28.0; beside one CPU-bound process, spinning 25.3, 27.3, 27.3 and passive 26.7, 27.8, 26.7.
(Choosing passive waits at start from the load average, as quickdraft once did, made a process
started after a busy minute slow for its whole life.) The kernels give a row the same bits
whatever the thread count (each output is one thread's), so the count changes no output; the
governor is off where the layers do not run on the kernels, and where the user chose the count
(``--threads``, ``OMP_NUM_THREADS``). A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is
libgomp's to read, as always: passive waits still suit a count pinned beside busy processes.

In a container with a CPU limit (Kubernetes' ``limits.cpu``, ``docker run --cpus``), the process
may run on all the node's cores (its affinity) but for only the limit's worth of CPU time (its
control group's quota): threads beyond the limit take turns on it, and a parallel region waits for
the last of them. So the default count is the affinity's cores or the quota's whole CPUs,
whichever is fewer (``usable_cpus``), as Go's runtime and the JVM read the quota (``cpu_quota``).

Terms: the *wait policy* is ``OMP_WAIT_POLICY`` (passive: sleep at once); libgomp reads it once,
when it is loaded (with ``import torch``). The *thread count* is torch's intra-op threads
(``torch.set_num_threads``), which the kernels' parallel regions follow too (both ask the calling
thread's OpenMP setting).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from quickdraft.errors import ConfigError

def _affinity() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cpu_quota(root: str | Path = "/sys/fs/cgroup", proc: str | Path = "/proc/self/cgroup") -> float | None:
    """The CPUs' worth of time this process's control group and the groups above it allow, the
    tightest of them (cgroup v2 ``cpu.max``; v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``),
    or None: no limit, or no cgroups (another OS). In a container the group is usually the
    mount's root (a cgroup namespace); a group path the mount does not show is skipped."""
    root = Path(root)
    text = _read(Path(proc))
    if text is None:
        return None
    limits = []
    for line in text.splitlines():
        if line.count(":") < 2:
            continue
        _, controllers, group = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            mounts, files = [root], ("cpu.max",)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            mounts, files = [root / "cpu", root / controllers], ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        parts = [p for p in group.strip().split("/") if p]
        for mount in mounts:
            for depth in range(len(parts) + 1):
                values = [_read(mount.joinpath(*parts[:depth], f)) for f in files]
                if None not in values and (limit := _limit(values)) is not None:
                    limits.append(limit)
    return min(limits) if limits else None


def _limit(values: list[str]) -> float | None:
    """One group's CPUs of quota from its files' text (v2: "quota period"; v1: the quota, then
    the period), None where it sets no limit (v2 "max", v1 -1) or the text is not numbers."""
    try:
        quota, period = values[0].split() if len(values) == 1 else (values[0], values[1])
        q, p = float(quota), float(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cpus() -> int:
    """The cores this process can keep busy: its affinity's, or the whole CPUs of its control
    group's quota where fewer (at least 1)."""
    cpus, quota = _affinity(), cpu_quota()
    return cpus if quota is None else max(1, min(cpus, math.floor(quota)))


def fit_to_quota() -> None:
    """Torch's default thread count counts the node's cores; where the process's CPU quota allows
    fewer, run on those (unless the user chose the count)."""
    import torch

    usable = usable_cpus()
    if not _pinned and torch.get_num_threads() > usable:
        torch.set_num_threads(usable)


_pinned = "OMP_NUM_THREADS" in os.environ  # the user chose the count: nothing changes it


def set_threads(threads: int) -> None:
    """Run torch and the kernels on ``threads`` threads, for good (no ``ThreadGovernor`` changes
    it). Without a call they run on torch's default: one thread per physical core the process may
    run on (its CPU affinity), or ``$OMP_NUM_THREADS``."""
    global _pinned
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"threads must be an integer >= 1, got {threads!r}", "threads")
    import torch

    torch.set_num_threads(threads)
    _pinned = True


def threads_for(others: float, threads: int, most: int, cpus: int) -> int:
    """The thread count for the next passes, from ``others``, the cores other processes kept busy
    lately (their share of the machine's CPU time x ``cpus``), with ``threads`` running now and
    ``most`` the count to come back to. Fewer where the others need more than the cores left to
    them (by half a core: a kernel thread's noise is not a process), more where a whole core
    stands idle (by 0.3 of one), so that it does not swing between the two."""
    if others > cpus - threads + 0.5:
        return max(1, min(threads, cpus - round(others)))
    if others < cpus - threads - 0.7:
        return max(1, min(most, cpus - math.ceil(others - 0.3)))
    return threads


class ThreadGovernor:
    """Runs the passes on the cores other processes leave free (see the module's docstring).
    ``update`` is called before each engine step, from the thread that runs the passes (an
    OpenMP thread count is that thread's own); it looks at the machine every ``interval`` s.
    One for the process (``governor()``): engines made later must come back to the count the
    process started with, not to one an earlier engine had lowered."""

    def __init__(self, interval: float = 0.5, sample=None, share=None):
        import torch

        from quickdraft.models.pass_cost import cpu_sample, others_share

        self.torch = torch
        self.cpus = _affinity()
        self.most = torch.get_num_threads()
        self.interval = max(interval, 1.0 / self.cpus)  # others_share needs a CPU second in all
        self.sample, self.share = sample or cpu_sample, share or others_share
        self.changes = 0  # times it changed the count (the tests and the shared-cores measurement read it)
        self._last, self._at = self.sample(), time.monotonic()

    def update(self) -> int:
        """The thread count for this step (changed where the machine's load calls for it)."""
        now = time.monotonic()
        threads = self.torch.get_num_threads()
        if _pinned or now - self._at < self.interval:
            return threads
        sample = self.sample()
        share = self.share(self._last, sample)
        self._last, self._at = sample, now
        if share is None:
            return threads
        want = threads_for(share * self.cpus, threads, self.most, self.cpus)
        if want != threads:
            self.torch.set_num_threads(want)
            self.changes += 1
        return want


_governor: ThreadGovernor | None = None


def governor() -> ThreadGovernor:
    """The process's ThreadGovernor, made on first use."""
    global _governor
    if _governor is None:
        _governor = ThreadGovernor()
    return _governor
