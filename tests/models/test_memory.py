"""models/memory.py: weights in transparent huge pages, copied or read from a file, unchanged."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from quickdraft.models import memory
from quickdraft.models.ggml import BlockWeight

pytestmark = pytest.mark.skipif(not memory.supported(), reason="no transparent huge pages on this system")


def test_weights_are_moved_unchanged_and_a_tied_tensor_once():
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(300, 128, generator=g).to(torch.bfloat16)
    block = BlockWeight("Q8_0", torch.randint(0, 255, (4, 17408), dtype=torch.uint8, generator=g), 1024, 64)  # 4 tiles of 16 rows
    small = torch.ones(8)
    weights = {"embed": embed, "head": embed, "blocks": block, "norm": small}
    want = {"embed": embed.clone(), "data": block.data.clone()}
    out = memory.into_huge_pages(weights)
    assert out is weights  # updated in place
    assert out["head"] is out["embed"] and torch.equal(out["embed"], want["embed"])
    assert memory.in_huge_pages(out["embed"]) and out["embed"].data_ptr() % memory.ALIGN == 0
    assert isinstance(out["blocks"], BlockWeight) and memory.in_huge_pages(out["blocks"].data)
    assert torch.equal(out["blocks"].data, want["data"]) and out["blocks"].in_features == 1024
    assert out["norm"] is small  # too small to be worth a page
    assert memory.into_huge_pages(dict(out))["embed"] is out["embed"]  # not copied twice


def test_fresh_copies_leave_the_old_arena_to_be_freed():
    """``fresh``: every tensor is copied, those already in an arena and the small ones too, so that
    nothing of the old arena's stays referenced (a requantized draft's kept weights)."""
    g = torch.Generator().manual_seed(1)
    first = memory.into_huge_pages({"w": torch.randn(512, 256, generator=g), "norm": torch.ones(8)})
    assert memory.in_huge_pages(first["w"])
    old = {k: v.clone() for k, v in first.items()}
    moved = memory.into_huge_pages(dict(first), fresh=True)
    for k in old:
        assert torch.equal(moved[k], old[k])
        assert moved[k].untyped_storage().data_ptr() != first[k].untyped_storage().data_ptr()
    assert memory.in_huge_pages(moved["w"])


def test_a_safetensors_file_reads_as_safetensors_reads_it(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(70, 33, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
               "c": torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=g), "d": torch.tensor([7]),
               "e": torch.empty(0, 4)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"blocks": "{}"})
    got, meta = memory.read_safetensors(path)
    want = load_file(str(path))
    assert meta == {"blocks": "{}"} and got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    path.write_bytes(path.read_bytes()[:-10])  # cut short
    with pytest.raises(ValueError, match="cut short"):
        memory.read_safetensors(path)
