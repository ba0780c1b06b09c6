"""The kernels' cores for every instruction set, built without torch as one small program
(tests/native): on this machine, each x86 ISA the CPU runs; and the ARM64 NEON kernels,
cross-compiled with Debian's aarch64 toolchain and run under qemu-user (the Makefile installs
both where it can; without them these tests skip with one line). Each ISA's rows must be
invariant over 1..19 rows and carry the portable reference's bits where simd.h promises them
(tests/native/kernels_test.cpp)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from quickdraft.kernels import isa

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "tests" / "native"
CXXFLAGS = ["-std=c++17", "-O2", "-ffp-contract=off", "-fopenmp"]
# the ISAs each host's program holds (kernels_test.cpp's tables): x86_64 and aarch64
OBJECTS = {"x86_64": ("avx512", "avx2_vnni", "avx2", "portable"), "aarch64": ("neon", "portable")}
# the AVX-VNNI path with vpdpbusd rendered in AVX2 (isa_avx2.h): its kernels run on any AVX2 CPU
EMULATED_VNNI = ("-mavx2", "-mfma", "-mf16c", "-DQD_ISA_AVX2_VNNI", "-DQD_EMULATE_AVX_VNNI")


def build(tmp: Path, cxx: str, machine: str, features: frozenset[str], flags_of: dict | None = None) -> Path:
    """kernels_test for ``machine``: one object per ISA (compiled with its flags whatever this CPU
    runs: compiling is not running; ``flags_of`` replaces an ISA's), linked with the driver."""
    objects, jobs = [], []
    for name in OBJECTS[machine]:  # compiled side by side
        obj = tmp / f"{name}.o"
        flags = (flags_of or {}).get(name) or isa.BY_NAME[name].flags(features)
        jobs.append(subprocess.Popen([cxx, *CXXFLAGS, *flags, f"-DQD_PREFIX={name}", "-c", str(NATIVE / "kernels_isa.cpp"),
                                      "-o", str(obj)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        objects.append(str(obj))
    for job in jobs:
        out, _ = job.communicate()
        assert job.returncode == 0, out[-3000:]
    exe = tmp / "kernels_test"
    subprocess.run([cxx, *CXXFLAGS, str(NATIVE / "kernels_test.cpp"), *objects, "-o", str(exe)], check=True,
                   capture_output=True, text=True)
    return exe


def run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    failures = [line for line in out.stdout.splitlines() if line.startswith("FAIL")]
    assert out.returncode == 0 and not failures, out.stdout[-3000:] + out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.endswith(" 0 failed") and not last.startswith("0 passed"), last
    return last


@pytest.mark.skipif(isa.arch() not in OBJECTS, reason=f"no native kernel test program for {isa.arch()}")
def test_every_isa_this_cpu_runs(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    features = isa.cpu_features()
    exe = build(tmp_path, "g++", isa.arch(), features)
    names = [i.name for i in isa.ISAS if i.name in OBJECTS[isa.arch()] and isa.runs_here(i)]
    # vdpbf16ps rounds a bfloat16 dot its own way: its bits are compared with nothing but themselves
    names = [f"{n}+bf16" if n == "avx512" and "avx512_bf16" in features else n for n in names]
    print(run([str(exe), *names]), "for", " ".join(names))


def test_avx512_without_bf16(tmp_path):
    """Ice Lake and Cascade Lake Xeons: AVX-512 with VNNI and without BF16, whose bfloat16 dot is two
    FMAs (isa_avx512.h), with the portable reference's bits. Built here without -mavx512bf16 on any
    CPU that runs AVX-512, so that path is tested where no such CPU is at hand."""
    if isa.arch() != "x86_64" or not isa.runs_here(isa.BY_NAME["avx512"]) or shutil.which("g++") is None:
        pytest.skip("this CPU runs no AVX-512 (or no g++)")
    exe = build(tmp_path, "g++", "x86_64", isa.cpu_features() - {"avx512_bf16"})
    print(run([str(exe), "avx512"]), "for avx512 without BF16")


def test_avx2_vnni_emulated(tmp_path):
    """The AVX-VNNI path's kernels (Intel Alder Lake and later, AMD Zen 5) on a CPU without it: its
    one instruction, vpdpbusd, rendered exactly in AVX2, the rest of the path as it is built for
    such a CPU (FULL_U8, simd.h's partial sums). The build that such a CPU runs is compiled beside
    it and must hold the instruction."""
    if isa.arch() != "x86_64" or not isa.runs_here(isa.BY_NAME["avx2"]) or shutil.which("g++") is None:
        pytest.skip("this CPU runs no AVX2 (or no g++)")
    real = tmp_path / "real"
    real.mkdir()
    build(real, "g++", "x86_64", isa.cpu_features())
    dump = subprocess.run(["objdump", "-d", str(real / "avx2_vnni.o")], capture_output=True, text=True) if shutil.which("objdump") else None
    if dump is not None:
        assert "vpdpbusd" in dump.stdout and "vpmaddubsw" not in dump.stdout
    exe = build(tmp_path, "g++", "x86_64", isa.cpu_features(), {"avx2_vnni": EMULATED_VNNI})
    print(run([str(exe), "avx2_vnni"]), "for avx2_vnni, vpdpbusd emulated")


def test_arm64_neon_under_qemu(tmp_path):
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if cxx is None or qemu is None:
        pytest.skip("no aarch64 cross tools (apt-get install g++-aarch64-linux-gnu qemu-user): NEON kernels untested here")
    exe = build(tmp_path, cxx, "aarch64", frozenset())
    # -cpu max: an emulated CPU with dotprod; -L: the aarch64 libraries (libstdc++, libgomp)
    print(run([qemu, "-cpu", "max", "-L", "/usr/aarch64-linux-gnu", str(exe), "portable", "neon"]))
