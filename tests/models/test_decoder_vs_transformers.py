"""Our decoder against an independent implementation: transformers loads the same GGUF file
(``gguf_file=``, dequantized to float32 by its own code) and must give the same logits, to within
float32 noise (different kernels and summation order: a tolerance, said here, of 1e-3 absolute on
logits of magnitude ~10-30, and the same argmax at every position)."""

from __future__ import annotations

import pytest
import torch

from quickdraft.models.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.models.loader import load_model

transformers = pytest.importorskip("transformers")


def test_smollm2_logits_match_transformers(smollm2_path):
    ours = load_model(str(smollm2_path), torch.float32, quantization="none")  # the weights transformers reads
    ids = ours.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return")
    decoder = Decoder(ours.config, ours.weights)
    kv = KVCache(ours.config, 1, 64, torch.float32)
    meta = AttentionMetadata.chain([0], [0], [len(ids)])
    with torch.inference_mode():
        mine = decoder.logits(decoder.forward(torch.tensor(ids), meta.positions("cpu"), kv, meta))
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, torch_dtype=torch.float32)
    with torch.inference_mode():
        theirs = theirs_model(torch.tensor([ids])).logits[0].float()
    assert mine.shape == theirs.shape
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    assert (mine - theirs).abs().max().item() < 1e-3
