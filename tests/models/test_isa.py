"""Which instruction set the kernels are built for (kernels/isa.py): the CPU's features as
Linux (x86 flags, ARM Features and hwcaps) and macOS (sysctl) tell them, the best ISA of the table,
and QUICKDRAFT_ISA forcing a lower one. Pure Python: the CPUs are described, not needed."""

from __future__ import annotations

import pytest

from quickdraft.kernels import isa

ZEN3 = frozenset("fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2".split())
ZEN4 = ZEN3 | frozenset("avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512vbmi".split())
ICE_LAKE = ZEN4 - {"avx512_bf16"}
ALDER_LAKE = ZEN3 | frozenset("avx_vnni movdiri serialize".split())  # AVX-VNNI without AVX-512
HASWELL_NO_F16C = ZEN3 - {"f16c"}
GRAVITON2 = frozenset("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp".split())
CORTEX_A72 = frozenset("fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid".split())


@pytest.mark.parametrize("features,machine,want,key", [
    (ZEN4, "x86_64", "avx512", "avx512-avx512_bf16"),
    (ICE_LAKE, "x86_64", "avx512", "avx512"),  # no BF16: the bfloat16 dot as two FMAs, every other kernel the same
    (ZEN3, "x86_64", "avx2", "avx2"),
    (ALDER_LAKE, "x86_64", "avx2_vnni", "avx2_vnni"),
    (ZEN4 | {"avx_vnni"}, "x86_64", "avx512", "avx512-avx512_bf16"),  # Zen 5, Sapphire Rapids: AVX-512 first
    (HASWELL_NO_F16C, "x86_64", "portable", "portable"),
    (GRAVITON2, "aarch64", "neon", "neon"),
    (CORTEX_A72, "aarch64", "portable", "portable"),  # NEON without dotprod
    (ZEN4, "riscv64", "portable", "portable"),
])
def test_the_best_isa_the_cpu_runs(features, machine, want, key):
    chosen = isa.best(features, machine)
    assert chosen.name == want and chosen.key(features) == key
    assert f"-DQD_ISA_{want.upper()}" in chosen.flags(features)


def test_avx512_bf16_flag_only_where_the_cpu_has_it():
    avx512 = isa.BY_NAME["avx512"]
    assert "-mavx512bf16" in avx512.flags(ZEN4) and "-mavx512bf16" not in avx512.flags(ICE_LAKE)


def test_forcing_a_lower_isa_and_refusing_what_the_cpu_lacks():
    assert isa.choose("avx2", ZEN4, "x86_64").name == "avx2"
    assert isa.choose("avx2", ALDER_LAKE, "x86_64").name == "avx2"  # the path without VNNI, tested there too
    with pytest.warns(UserWarning, match="QUICKDRAFT_ISA=avx2_vnni, but this CPU lacks"):
        assert isa.choose("avx2_vnni", ZEN3, "x86_64").name == "avx2"
    assert isa.choose("portable", ZEN4, "x86_64").name == "portable"
    with pytest.warns(UserWarning, match="QUICKDRAFT_ISA=avx512, but this CPU lacks"):
        assert isa.choose("avx512", ZEN3, "x86_64").name == "avx2"
    with pytest.warns(UserWarning, match="or is not aarch64.: using avx512"):
        assert isa.choose("neon", ZEN4, "x86_64").name == "avx512"
    with pytest.raises(ValueError, match="QUICKDRAFT_ISA=sse9: not one of avx512, avx2_vnni, avx2, neon, portable"):
        isa.choose("sse9", ZEN4, "x86_64")


def test_the_environment_variable_forces_it(monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_ISA", "portable")
    assert isa.choose().name == "portable"
    monkeypatch.setenv("QUICKDRAFT_ISA", "")
    assert isa.choose() == isa.best()


def test_linux_cpuinfo_x86_flags_and_arm_features():
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 fma f16c\nbugs\t\t: sysret_ss_attrs\n"
    assert isa._linux_features(x86) == {"fpu", "avx2", "fma", "f16c"}
    arm = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd asimddp\nCPU implementer\t: 0x41\n"
    assert isa._linux_features(arm) == {"fp", "asimd", "asimddp"}
    assert isa._linux_features("processor\t: 0\n") == set()


def test_macos_sysctl(monkeypatch):
    monkeypatch.setattr(isa, "arch", lambda: "aarch64")
    monkeypatch.setattr(isa, "_sysctl", lambda *names: ["1", "1", "0"][: len(names)])
    assert isa._mac_features() == {"asimd", "asimddp"}
    monkeypatch.setattr(isa, "arch", lambda: "x86_64")
    monkeypatch.setattr(isa, "_sysctl", lambda *names: ["FPU SSE AVX1.0 F16C FMA", "AVX2 BMI2 AVXVNNI"])
    assert isa._mac_features() == {"f16c", "fma", "avx2", "avx_vnni"}


def test_this_machine_has_a_choice():
    """Whatever this CPU is, some ISA runs (the portable one at least), and it is the best one."""
    chosen = isa.best()
    assert isa.runs_here(chosen)
    assert all(not isa.runs_here(better) for better in isa.ISAS[: isa.ISAS.index(chosen)])
