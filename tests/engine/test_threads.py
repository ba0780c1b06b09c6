"""CPU threads (engine/threads.py): OpenMP keeps libgomp's spinning whatever the load when
quickdraft starts, a user's own wait policy reaches the OpenMP runtime, and ``--threads`` /
``LLM(threads=...)`` set the thread count."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from quickdraft import LLM
from quickdraft.commands import cli, generate as generate_command
from quickdraft.engine import threads
from quickdraft.models.loader import LoadedModel
from quickdraft.models.tiny import random_weights, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def runtime_settings(load: float = 99.0, **env: str) -> tuple[str, str]:
    """(what libgomp prints of its settings when it loads, $OMP_WAIT_POLICY afterwards) in a fresh
    process that imports quickdraft, with ``load`` as its 1-minute load average."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = (f"import os; os.getloadavg = lambda: ({load}, 0.0, 0.0); import quickdraft, torch; torch.ones(4).sum(); "
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean, "OMP_DISPLAY_ENV": "VERBOSE", **env},
                         capture_output=True, text=True, check=True)
    return out.stderr, out.stdout.strip()


@pytest.mark.parametrize("load", [0.0, 99.0])
def test_openmp_spins_however_busy_the_machine_was(load):
    """libgomp's default (300,000 spins before a sleep) whatever the load average at start: the
    thread count, not the wait policy, follows the machine. Child processes see no setting."""
    settings, variable = runtime_settings(load=load)
    assert "GOMP_SPINCOUNT = '300000'" in settings and variable == "None"


@pytest.mark.parametrize("env, shown", [({"OMP_WAIT_POLICY": "ACTIVE"}, "OMP_WAIT_POLICY = 'ACTIVE'"),
                                        ({"GOMP_SPINCOUNT": "1234"}, "GOMP_SPINCOUNT = '1234'")])
def test_a_users_wait_policy_is_kept(env, shown):
    assert shown in runtime_settings(**env)[0]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def openmp_threads() -> int:
    """The OpenMP runtime's thread count for this thread: what the kernels' parallel regions use
    (torch's libgomp, loaded already, answers to its name)."""
    return ctypes.CDLL("libgomp.so.1").omp_get_max_threads()


def test_threads_flag_sets_torchs_and_the_kernels_threads(monkeypatch, restore_threads):
    seen = []
    monkeypatch.setattr(generate_command, "generate", lambda args: seen.append((torch.get_num_threads(), openmp_threads())) or 0)
    torch.set_num_threads(2)
    assert cli.main(["generate", "hi", "--threads", "1"]) == 0 and seen == [(1, 1)]
    assert cli.main(["generate", "hi"]) == 0 and seen == [(1, 1)] * 2  # no flag: left as it is


def test_bad_threads_flag_is_a_clear_error(capsys):
    assert cli.main(["generate", "hi", "--threads", "0"]) == 2
    assert "threads must be an integer >= 1, got 0" in capsys.readouterr().err


def test_llm_threads(restore_threads):
    config = tiny_config("qwen2", vocab_size=64, hidden_size=32, num_layers=1)
    LLM(LoadedModel(config, random_weights(config, seed=0), None, "tiny"), threads=1, dtype="float32")
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("others, threads, want", [
    (0.05, 2, 2),  # quiet: as many as at the start
    (0.67, 2, 1),  # one busy process beside two threads that wait on each other: one thread
    (1.0, 1, 1),  # it keeps its core: stay at one
    (0.5, 1, 1),  # half a core idle: not enough to come back
    (0.1, 1, 2),  # it left: back up
])
def test_threads_follow_the_cores_others_leave_free(others, threads, want):
    from quickdraft.engine.threads import threads_for

    assert threads_for(others, threads, most=2, cpus=2) == want


def test_threads_on_a_larger_machine():
    from quickdraft.engine.threads import threads_for

    assert threads_for(3.0, 16, most=16, cpus=16) == 13
    assert threads_for(1.0, 13, most=16, cpus=16) == 15  # two cores came free: one kept for the noise
    assert threads_for(0.0, 15, most=15, cpus=16) == 15  # never past the count it started with


def test_the_governor_changes_torchs_and_the_kernels_threads(monkeypatch, restore_threads):
    """Fed other processes' shares of the machine, it sets the count for torch and for the
    kernels' OpenMP regions alike, looks no more often than its interval, and leaves a count the
    user chose alone."""
    monkeypatch.setattr(threads, "_pinned", False)
    torch.set_num_threads(2)
    shares = iter([0.4, 0.02, 0.4])  # others: 0.8 of the 2 cores, then none, then 0.8 again
    gov = threads.ThreadGovernor(sample=lambda: None, share=lambda a, b: next(shares))
    gov.cpus, gov.interval = 2, 0.0
    assert gov.update() == 1 and (torch.get_num_threads(), openmp_threads()) == (1, 1)
    assert gov.update() == 2 and openmp_threads() == 2
    gov.interval = 3600.0
    assert gov.update() == 2 and gov.changes == 2  # not looked at again within the interval
    gov.interval = 0.0
    monkeypatch.setattr(threads, "_pinned", True)
    assert gov.update() == 2 and gov.changes == 2


def test_an_engine_on_the_kernels_has_the_processs_governor():
    config = tiny_config("qwen2", vocab_size=64, hidden_size=32, num_layers=1)
    llm = LLM(LoadedModel(config, random_weights(config, seed=0), None, "tiny"), dtype="float32")
    if llm.engine.decoder.native is None:
        assert llm.engine.threads is None  # no kernels here: torch's own operations keep their count
    else:
        assert llm.engine.threads is threads.governor()


def control_groups(tmp_path, proc_cgroup: str, files: dict[str, str]):
    """A cgroup mount under tmp_path holding ``files`` (path: text), and /proc/self/cgroup's text."""
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_cgroup)
    return root, proc


V1_DOCKER = "12:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n1:name=systemd:/docker/x\n"


@pytest.mark.parametrize("proc_cgroup, files, want", [
    # v2 in a container: a cgroup namespace shows the container's group as the mount's root
    ("0::/\n", {"cpu.max": "200000 100000\n"}, 2.0),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    # v2 from the host: the tightest of the group and the groups above it
    ("0::/kubepods/pod1/c1\n", {"cpu.max": "max 100000\n", "kubepods/cpu.max": "400000 100000\n",
                                "kubepods/pod1/c1/cpu.max": "150000 100000\n"}, 1.5),
    ("0::/kubepods/pod1/c1\n", {"kubepods/cpu.max": "400000 100000\n", "kubepods/pod1/c1/cpu.max": "max 100000\n"}, 4.0),
    # a group the mount does not show (no cgroup namespace): the mount's root is read
    ("0::/system.slice/x.scope\n", {"cpu.max": "300000 100000\n"}, 3.0),
    # v1: the cpu controller's own hierarchy (mounted as cpu,cpuacct, or cpu); -1 is no limit
    (V1_DOCKER, {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n"}, 0.5),
    ("4:cpu,cpuacct:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ("0::/\n", {"cpu.max": "garbage\n"}, None),
    ("", {}, None),
])
def test_the_cpu_quota_of_the_processs_control_group(tmp_path, proc_cgroup, files, want):
    assert threads.cpu_quota(*control_groups(tmp_path, proc_cgroup, files)) == want


def test_no_cgroups_is_no_quota(tmp_path):
    assert threads.cpu_quota(tmp_path / "no-mount", tmp_path / "no-proc-file") is None


@pytest.mark.parametrize("quota, want", [(None, 2), (8.0, 2), (2.0, 2), (1.5, 1), (0.25, 1)])
def test_the_default_thread_count_fits_a_cpu_quota(monkeypatch, restore_threads, quota, want):
    """On 2 cores: torch's default counts the cores, a container's CPU limit may allow fewer."""
    monkeypatch.setattr(threads, "_affinity", lambda: 2)
    monkeypatch.setattr(threads, "cpu_quota", lambda: quota)
    monkeypatch.setattr(threads, "_pinned", False)
    torch.set_num_threads(2)
    assert threads.usable_cpus() == want
    threads.fit_to_quota()
    assert torch.get_num_threads() == want and openmp_threads() == want


def test_a_chosen_thread_count_is_kept_under_a_quota(monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "cpu_quota", lambda: 1.0)
    monkeypatch.setattr(threads, "_pinned", True)  # --threads, LLM(threads=...) or $OMP_NUM_THREADS
    torch.set_num_threads(2)
    threads.fit_to_quota()
    assert torch.get_num_threads() == 2
