"""kernels/forward.cpp runs a whole pass (every layer, the final norm) in one call; it must be the
Python path (models/decoder/reference.py) bit for bit: hidden states, captured states and KV
caches, for chains, token trees (hidden nodes of an earlier pass included) and ragged batches of
several sequences, with dense float32 and bfloat16 weights and GGUF blocks, on every instruction
set's kernels this CPU runs."""

from __future__ import annotations

import pytest
import torch
from test_fused_layer import LAYOUTS, PASSES, model, run, tree_mask  # tests/models is on the path, as pytest collects it

from quickdraft.models.kv_cache import KVCache
from quickdraft import kernels
from quickdraft.models.decoder import MAX_ROW_BY_ROW, AttentionMetadata
from quickdraft.kernels import isa, native_decoder

pytestmark = pytest.mark.skipif(native_decoder() is None, reason="the CPU kernels are not available here")

# a draft growing a tree a level a pass: 3 nodes under slot 2's context, then 2 more whose paths
# run through the first pass's nodes (hidden: already in the cache), beside a plain step of slot 0
HIDDEN = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
NATIVE_PASSES = PASSES + [
    (AttentionMetadata([2], [25], [3], [tree_mask([-1, 0, 0])]), None),
    (AttentionMetadata([2, 0], [28, 51], [2, 1], [HIDDEN, None]), None),
]
ONE_CALL = sum(max(meta.query_lens) <= MAX_ROW_BY_ROW for meta, _ in NATIVE_PASSES)  # the 40-row prefill: Python


def assert_same(got, want, kv_got: KVCache, kv_want: KVCache):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True):
            assert torch.isfinite(x).all()
            assert torch.equal(x, y), f"pass {i}: largest difference {(x.float() - y.float()).abs().max()}"
    for layer in range(len(kv_got.keys)):
        assert torch.equal(kv_got.keys[layer], kv_want.keys[layer]), f"layer {layer}'s keys"
        assert torch.equal(kv_got.values[layer], kv_want.values[layer]), f"layer {layer}'s values"


def counted(decoder) -> list:
    """Calls to the one-call pass, counted."""
    calls, original = [], decoder.native.forward
    decoder.native.forward = lambda *a: calls.append(1) or original(*a)
    return calls


@pytest.mark.parametrize("layout", [None, *LAYOUTS], ids=["dense", *LAYOUTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_one_call_is_the_python_path_bit_for_bit(dtype, layout):
    decoder = model(dtype, layout)
    calls = counted(decoder)
    native, kv_native = run(decoder, "pass", NATIVE_PASSES)
    assert len(calls) == ONE_CALL  # the passes did go through forward.cpp
    python, kv_python = run(decoder, "python", NATIVE_PASSES)
    assert_same(native, python, kv_native, kv_python)
    per_layer, kv_layer = run(decoder, "layer", NATIVE_PASSES)
    assert_same(native, per_layer, kv_native, kv_layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_captured_states_are_the_python_paths(dtype):
    """EAGLE-3 reads the residual stream entering chosen layers, in the order asked."""
    decoder = model(dtype, "q4_k_m")
    passes = [p for p in NATIVE_PASSES if p[1] is None]
    calls = counted(decoder)
    native, kv_native = run(decoder, "pass", passes, capture=(1, 0))
    assert calls and all(isinstance(out, tuple) and out[1].shape[1] == 2 * decoder.config.hidden_size for out in native)
    python, kv_python = run(decoder, "python", passes, capture=(1, 0))
    assert_same(native, python, kv_native, kv_python)
    with pytest.raises(ValueError, match="cannot capture"):
        run(decoder, "pass", passes[1:2], capture=(2,))


def test_profiling_times_the_layers_and_changes_no_bit():
    """``quickdraft profile``'s split: with profiling on, a pass adds its layers' time in three
    parts (matrices, attention, the rest), from zero each time it goes on, and its output and
    caches keep their bits."""
    decoder = model(torch.bfloat16, "q4_k_m")
    plain, kv_plain = run(decoder, "pass", NATIVE_PASSES)
    native = decoder.native._model
    native.set_profiling(True)
    try:
        profiled, kv_profiled = run(decoder, "pass", NATIVE_PASSES)
        matrices, attention, other = native.times
        assert matrices > 0 and attention > 0 and other > 0
        native.set_profiling(True)
        assert native.times == (0.0, 0.0, 0.0)
    finally:
        native.set_profiling(False)
    assert_same(profiled, plain, kv_profiled, kv_plain)
    run(decoder, "pass", NATIVE_PASSES[:1])
    assert native.times == (0.0, 0.0, 0.0)  # off: nothing added


def test_skipped_sublayers_take_the_layer_path_with_the_same_bits():
    """Layer skipping leaves sublayers out: no one-call pass, and still the Python path's bits."""
    decoder = model(torch.float32, "mixed")
    calls = counted(decoder)
    native, kv_native = run(decoder, "pass", NATIVE_PASSES, skip_mlp={1})
    assert not calls
    python, kv_python = run(decoder, "python", NATIVE_PASSES, skip_mlp={1})
    assert_same(native, python, kv_native, kv_python)


HERE = [i.name for i in isa.ISAS if isa.runs_here(i)]


@pytest.mark.parametrize("layout", [None, "q4_k_m", "mixed"], ids=["dense", "q4_k_m", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", HERE)
def test_every_instruction_set_here(name, dtype, layout, monkeypatch):
    """QUICKDRAFT_ISA picks any instruction set the CPU runs: each build's one-call pass is its
    own Python path bit for bit (every kernel the decoder calls comes from that build)."""
    module = kernels.build(isa.BY_NAME[name])
    if module is None:
        pytest.skip(f"the {name} kernels did not build")
    monkeypatch.setattr(kernels, "_module", lambda: module)
    decoder = model(dtype, layout)
    assert decoder.native is not None
    calls = counted(decoder)
    native, kv_native = run(decoder, "pass", NATIVE_PASSES)
    assert len(calls) == ONE_CALL
    python, kv_python = run(decoder, "python", NATIVE_PASSES)
    assert_same(native, python, kv_native, kv_python)


def test_the_metadata_is_checked():
    decoder = model(torch.float32, None)
    kv = KVCache(decoder.config, 2, 64, decoder.dtype)
    x = torch.zeros(3, decoder.config.hidden_size)
    forward = decoder.native._model.forward
    with pytest.raises(RuntimeError, match="add up"):
        forward(x, torch.arange(3), kv.keys, kv.values, [0], [0], [2], [None], [None], 2, [])
    with pytest.raises(RuntimeError, match="runs past"):
        forward(x, torch.arange(3), kv.keys, kv.values, [1], [62], [3], [None], [None], 2, [])
    with pytest.raises(RuntimeError, match="no slot"):
        forward(x, torch.arange(3), kv.keys, kv.values, [2], [0], [3], [None], [None], 2, [])
