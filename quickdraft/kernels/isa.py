"""Which instruction set the CPU kernels are built for: the CPU's features, read the way each OS
tells them, and the table of the kernels' instruction sets, best first.

Each entry of ``ISAS`` is one header of the vector layer (simd.h: arch/isa_avx512.h, arch/isa_avx2.h (with
AVX-VNNI or without), arch/isa_neon.h, arch/isa_portable.h) and the compiler flags it needs. ``choose()`` takes the best one the
CPU runs, or the one ``QUICKDRAFT_ISA`` names (a lower one, to test its path on a machine that
has a better one). Plain Python, no torch: ``quickdraft check`` and the tests read it directly.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Isa:
    name: str  # what QUICKDRAFT_ISA takes, and what paths are named by
    arch: str  # "x86_64", "aarch64" or "any"
    needs: tuple[str, ...]  # CPU features, as Linux's /proc/cpuinfo names them
    cflags: tuple[str, ...]
    optional: dict | None = None  # feature -> extra flags where the CPU has it (one build each way)

    def flags(self, features: frozenset[str]) -> tuple[str, ...]:
        extra = [f for feat, flags in (self.optional or {}).items() if feat in features for f in flags]
        return self.cflags + tuple(extra) + (f"-DQD_ISA_{self.name.upper()}",)

    def key(self, features: frozenset[str]) -> str:
        """The build's name: the ISA and the optional features it was built with."""
        extra = [feat for feat in (self.optional or {}) if feat in features]
        return "-".join([self.name] + extra)


ISAS = (
    # AVX512-BF16 only feeds the bfloat16 dense linear (vdpbf16ps): Ice Lake and Cascade Lake Xeons
    # lack it and run that product as two FMAs, like AVX2. AMX intrinsics run only where cpuid
    # and Linux allow; the compiler never emits them itself.
    Isa("avx512", "x86_64", ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "fma", "f16c"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c", "-mamx-tile",
         "-mamx-int8"), {"avx512_bf16": ("-mavx512bf16",)}),
    # AVX-VNNI: vpdpbusd on 256 bits without AVX-512 (Intel Alder Lake and later, AMD Zen 5); the
    # avx2 path's header with its byte dot one instruction (isa_avx2.h)
    Isa("avx2_vnni", "x86_64", ("avx2", "fma", "f16c", "avx_vnni"), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni")),
    Isa("avx2", "x86_64", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    Isa("neon", "aarch64", ("asimd", "asimddp"), ("-march=armv8.2-a+dotprod",)),
    Isa("portable", "any", (), ()),
)
BY_NAME = {isa.name: isa for isa in ISAS}

# Linux's AT_HWCAP bits on aarch64 (asm/hwcap.h)
_AT_HWCAP = 16
_ARM_HWCAPS = {"asimd": 1 << 1, "asimddp": 1 << 20, "asimdhp": 1 << 10, "sve": 1 << 22}
# macOS sysctl names -> Linux's names
_MAC_ARM = {"hw.optional.neon": "asimd", "hw.optional.arm.FEAT_DotProd": "asimddp", "hw.optional.arm.FEAT_I8MM": "i8mm"}
_MAC_X86 = {"AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "AVX512F": "avx512f", "AVX512BW": "avx512bw",
            "AVX512DQ": "avx512dq", "AVX512VL": "avx512vl", "AVX512VNNI": "avx512_vnni", "AVX512BF16": "avx512_bf16",
            "AVXVNNI": "avx_vnni"}


def arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _linux_features(text: str) -> set[str]:
    """The flags (x86) or Features (ARM) line of /proc/cpuinfo."""
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip().lower()
        if key in ("flags", "features") and ":" in line:
            return set(line.split(":", 1)[1].split())
    return set()


def _arm_hwcaps() -> set[str]:
    """aarch64 Linux: the kernel's hwcaps (getauxval), which hold where /proc/cpuinfo is hidden."""
    try:
        caps = ctypes.CDLL(None).getauxval(ctypes.c_ulong(_AT_HWCAP))
    except (OSError, AttributeError):
        return set()
    return {name for name, bit in _ARM_HWCAPS.items() if caps & bit}


def _sysctl(*names: str) -> list[str]:
    try:
        out = subprocess.run(["sysctl", "-n", *names], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split("\n")


def _mac_features() -> set[str]:
    if arch() == "aarch64":
        values = _sysctl(*_MAC_ARM)
        return {feat for (name, feat), v in zip(_MAC_ARM.items(), values) if v.strip() == "1"} | {"asimd"}
    words = " ".join(_sysctl("machdep.cpu.features", "machdep.cpu.leaf7_features")).upper().split()
    return {_MAC_X86[w] for w in words if w in _MAC_X86}


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's features, named as Linux's /proc/cpuinfo names them ("avx2", "asimddp", ...)."""
    if platform.system() == "Darwin":
        return frozenset(_mac_features())
    try:
        found = _linux_features(Path("/proc/cpuinfo").read_text())
    except OSError:
        found = set()
    if arch() == "aarch64":
        found |= _arm_hwcaps()
    return frozenset(found)


def runs_here(isa: Isa, features: frozenset[str] | None = None, machine: str | None = None) -> bool:
    features = cpu_features() if features is None else features
    machine = arch() if machine is None else machine
    return isa.arch in ("any", machine) and all(f in features for f in isa.needs)


def best(features: frozenset[str] | None = None, machine: str | None = None) -> Isa:
    """The best of ``ISAS`` this CPU runs (the portable one at least)."""
    return next(isa for isa in ISAS if runs_here(isa, features, machine))


def choose(forced: str | None = None, features: frozenset[str] | None = None, machine: str | None = None) -> Isa:
    """The ISA to build for: ``forced`` (``QUICKDRAFT_ISA`` by default) where this CPU runs it,
    else the best. A name the table lacks is an error; one this CPU cannot run falls back to the
    best with a warning (running it would stop the process on an illegal instruction)."""
    forced = os.environ.get("QUICKDRAFT_ISA") if forced is None else forced
    if not forced:
        return best(features, machine)
    if forced not in BY_NAME:
        raise ValueError(f"QUICKDRAFT_ISA={forced}: not one of {', '.join(BY_NAME)}")
    isa = BY_NAME[forced]
    if not runs_here(isa, features, machine):
        fallback = best(features, machine)
        warnings.warn(f"quickdraft: QUICKDRAFT_ISA={forced}, but this CPU lacks one of {', '.join(isa.needs)} "
                      f"(or is not {isa.arch}): using {fallback.name}", stacklevel=2)
        return fallback
    return isa
