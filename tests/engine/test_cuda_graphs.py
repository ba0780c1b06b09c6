"""The decoding passes as CUDA graphs (models/decoder/graphs.py), in layers:

- on any machine: the graphs' padded, fixed-shape pass (``static_pass``, run eagerly through
  ``CudaGraphs(record=False)``) agrees with the ragged reference pass, writes each sequence's keys
  where the reference does, and writes nothing else but the spare slot;
- on a CUDA device: a replay gives the eager static pass's bits exactly, and speculative greedy
  output with graphs equals plain greedy output, with graphs and without, on tiny random models
  (drafts that always, never and sometimes agree).
"""

from __future__ import annotations


import pytest
import torch

from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.engine.engine import Engine
from quickdraft.models.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.models.decoder.graphs import CudaGraphs, batch_bucket, keys_bucket, static_pass
from quickdraft.models.loader import LoadedModel
from quickdraft.models.tiny import never_agreeing, perturbed, random_weights, tiny_config
from quickdraft.sampling import SamplingParams

CONFIG = tiny_config("qwen2", vocab_size=96, hidden_size=64, num_layers=2)
WEIGHTS = random_weights(CONFIG, seed=1, scale=2.0)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pass(meta: AttentionMetadata, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (sum(meta.query_lens),), generator=g)
    return tokens, meta.positions("cpu")


def _prefilled(model: Decoder, num_slots: int, contexts: list[int], spare: bool) -> KVCache:
    """A cache whose slots hold ``contexts[i]`` tokens each, written by the reference pass."""
    kv = KVCache(CONFIG, num_slots, 64, model.dtype, model.device, spare_slot=spare)
    for t in kv.keys + kv.values:  # the caches are compared whole, unwritten positions included
        t.zero_()
    meta = AttentionMetadata.chain(list(range(len(contexts))), [0] * len(contexts), contexts)
    tokens, positions = _pass(meta, seed=0)
    model.forward(tokens.to(model.device), positions.to(model.device), kv, meta)
    return kv


@pytest.mark.parametrize("q", [1, 3])
def test_padded_pass_agrees_with_the_reference_and_writes_only_its_slots(q):
    model = Decoder(CONFIG, WEIGHTS)
    contexts = [5, 9, 2, 7]
    meta = AttentionMetadata.chain([0, 2, 3], [5, 2, 7], [q] * 3)  # slot 1 is not in the pass
    tokens, positions = _pass(meta, seed=q)
    ref_kv = _prefilled(model, 4, contexts, spare=False)
    want = model.forward(tokens, positions, ref_kv, meta)
    kv = _prefilled(model, 4, contexts, spare=True)
    held = [k[1].clone() for k in kv.keys]
    got = CudaGraphs(model, record=False).forward(tokens, positions, kv, meta, CONFIG.num_layers)
    assert got.shape == want.shape  # three sequences padded to four: the padding row is cut off
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.logits(got).argmax(-1), model.logits(want).argmax(-1))
    for layer in range(CONFIG.num_layers):
        torch.testing.assert_close(kv.keys[layer][:4], ref_kv.keys[layer], rtol=1e-5, atol=1e-5)
        assert torch.equal(kv.keys[layer][1], held[layer])
        assert kv.keys[layer][4].abs().sum() > 0  # the padding row wrote to the spare slot


def test_passes_a_graph_does_not_take_run_eagerly():
    model = Decoder(CONFIG, WEIGHTS)
    graphs = CudaGraphs(model, record=False)
    kv = KVCache(CONFIG, 2, 64, model.dtype, spare_slot=True)
    mixed = AttentionMetadata.chain([0, 1], [0, 0], [1, 2])
    tokens, positions = _pass(mixed, seed=1)
    assert graphs.forward(tokens, positions, kv, mixed, CONFIG.num_layers) is None
    tree = AttentionMetadata([0], [0], [2], [torch.ones(2, 2, dtype=torch.bool).tril()])
    assert graphs.forward(tokens[:2], positions[:2], kv, tree, CONFIG.num_layers) is None
    no_spare = KVCache(CONFIG, 2, 64, model.dtype, spare_slot=False)
    one = AttentionMetadata.chain([0], [0], [1])
    assert graphs.forward(tokens[:1], positions[:1], no_spare, one, CONFIG.num_layers) is None
    assert not kv.graphs and not no_spare.graphs


def test_buckets():
    assert [batch_bucket(b) for b in (1, 3, 5, 17, 256, 257)] == [1, 4, 8, 24, 256, None]
    assert [keys_bucket(n, 4096) for n in (1, 256, 257, 3000, 5000)] == [256, 256, 512, 4096, 4096]
    assert keys_bucket(300, 320) == 320


# -- on a CUDA device -----------------------------------------------------------------------------

def _on(device, weights=WEIGHTS):
    return {k: v.to(device) for k, v in weights.items()}


@CUDA
@pytest.mark.parametrize("q, seqs", [(1, 1), (1, 3), (5, 3)])
def test_replay_gives_the_eager_static_pass_bits(q, seqs):
    model = Decoder(CONFIG, _on("cuda"))
    assert model.graphs is not None
    kv = _prefilled(model, 4, [5, 9, 2, 7], spare=True)
    meta = AttentionMetadata.chain(list(range(seqs)), [5, 9, 2][:seqs], [q] * seqs)
    tokens, positions = _pass(meta, seed=q)
    tokens, positions = tokens.cuda(), positions.cuda()
    eager_kv = _prefilled(model, 4, [5, 9, 2, 7], spare=True)
    b = batch_bucket(seqs)
    pad = b - seqs
    slots = torch.tensor(meta.slots + [eager_kv.spare_slot] * pad, device="cuda")
    with torch.inference_mode():
        want = static_pass(model, eager_kv, torch.cat([tokens, tokens.new_zeros(pad * q)]),
                           torch.cat([positions, torch.arange(q, device="cuda").repeat(pad)]), slots, q,
                           keys_bucket(max(meta.context_lens) + q, kv.max_len), CONFIG.num_layers)[: seqs * q]
    for _ in range(2):  # the capture, then a replay
        got = model.forward(tokens, positions, kv, meta)
        assert torch.equal(got, want)
    assert len(kv.graphs) == 1


def _engine(spec: dict | None, eager: bool, max_num_seqs: int = 4) -> Engine:
    target = LoadedModel(CONFIG, _on("cuda"), None, "tiny-target")
    if spec is not None:
        spec = {"adaptive": False, **spec}
    config = EngineConfig(model="tiny", dtype="float32", device="cuda", max_num_seqs=max_num_seqs,
                          speculative=SpeculativeConfig.parse(spec), enforce_eager=eager)
    return Engine(config, target=target)


def _drafts() -> dict[str, LoadedModel]:
    target = LoadedModel(CONFIG, _on("cuda"), None, "tiny-always")
    return {"always": target, "never": never_agreeing(target), "between": perturbed(target, 0.6, seed=3)}


PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42, 43, 44, 45, 46, 47, 1, 2, 3], [7]]
PARAMS = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)


@CUDA
def test_speculative_greedy_with_graphs_equals_plain():
    plain_engine = _engine(None, eager=False)
    plain = [o.token_ids for o in plain_engine.generate_ids(PROMPTS, PARAMS)]
    assert plain_engine.kv.graphs  # plain decoding replayed graphs
    assert [o.token_ids for o in _engine(None, eager=True).generate_ids(PROMPTS, PARAMS)] == plain
    for kind, draft in _drafts().items():
        for k in (1, 4):
            engine = _engine({"method": "draft_model", "model": draft, "num_speculative_tokens": k}, eager=False)
            outs = engine.generate_ids(PROMPTS, PARAMS)
            assert [o.token_ids for o in outs] == plain, (kind, k)
            assert engine.kv.graphs and engine.proposer.kv.graphs  # the target's and the draft's passes
            if kind == "always":
                assert engine.stats.acceptance_rate == 1.0
            if kind == "never":
                assert engine.stats.num_accepted_tokens == 0
