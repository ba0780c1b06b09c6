"""A draft model's chains in one native call (kernels/forward.cpp's ``chains``, through
DraftModelProposer._native_chains) must be the Python loop's, step after step: the same draft
tokens, the same draft cache bit for bit, the same count of cached tokens and the same cost
observations; sampled, also the same q bits and the same generator states after. The token table's rows and the output head are each dense or in every GGUF block
format (the rows dequantized in C++ against numpy's), the head whole or truncated, the chains
catching up, cut by K, by the confidence threshold, or not drafting at all this step."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_fused_layer import LAYOUTS, random_block_weight  # this folder is on the path, as pytest collects it

from quickdraft.models.decoder import Decoder
from quickdraft.kernels import native_decoder
from quickdraft.models.tiny import random_weights, tiny_config
from quickdraft.proposers.draft.model import DraftModelProposer
from quickdraft.sampling import SamplingParams, make_generator

pytestmark = pytest.mark.skipif(native_decoder() is None, reason="the CPU kernels are not available here")

VOCAB = 200  # not a multiple of 16: the tables' last tile is padded
GREEDY = SamplingParams(max_tokens=64, temperature=0)
WARM = SamplingParams(max_tokens=64, temperature=0.8)
# (token table, output head): every block format once in each, dense for neither
TABLES = [("Q4_0", "Q8_0"), ("Q4_1", "Q6_K"), ("Q4_K", "Q5_0"), ("Q8_0", "Q4_K"), ("Q5_0", "Q4_1"), ("Q6_K", "Q4_0")]


def draft_model(dtype: torch.dtype, tables: tuple[str, str] | None, head_ids: torch.Tensor | None = None) -> Decoder:
    """A 2-layer draft on Q4_K_M-like blocks, its token table and (untied) head dense (``tables``
    None) or in the given block formats; with ``head_ids`` the head keeps only those rows."""
    config = tiny_config("llama", vocab_size=VOCAB, hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=2)
    weights = random_weights(config, seed=5, dtype=dtype, scale=2.0)
    rng = np.random.default_rng(1)
    for name, w in list(weights.items()):
        kind = LAYOUTS["q4_k_m"].get(name.split(".")[-2])
        if kind is not None and name.endswith(".weight"):
            weights[name] = random_block_weight(kind, tuple(w.shape), rng)
    if tables is not None:
        for name, kind in zip(("model.embed_tokens.weight", "lm_head.weight"), tables):
            weights[name] = random_block_weight(kind, tuple(weights[name].shape), rng)
    if head_ids is not None:
        head = weights["lm_head.weight"]
        weights["lm_head.weight"] = head.select(head_ids) if tables is not None else head[head_ids].contiguous()
    return Decoder(config, weights)


class Seq:
    def __init__(self, slot: int, tokens: list[int], params: SamplingParams = GREEDY, seed: int = 0):
        self.slot, self.token_ids, self.params, self.grammar = slot, list(tokens), params, None
        self.generator = make_generator(seed, "cpu")

    def __len__(self) -> int:
        return len(self.token_ids)


class Observed:
    """A cost model that keeps what it is shown: (rows, chains, keys) of each timed pass."""

    def __init__(self):
        self.passes = []

    def observe(self, rows, seconds, chains=1, keys=0):
        assert seconds > 0
        self.passes.append((rows, chains, keys))


def drive(draft: Decoder, native: bool, threshold: float, head_ids: torch.Tensor | None, steps: int = 8,
          params: tuple[SamplingParams, SamplingParams] = (GREEDY, GREEDY), calls_expected: bool = True):
    """Draft, verify at random, commit, ``steps`` times, on 2 sequences (the first one's prompt
    read ahead, as the engine does; the second's read in its first pass) with ``params`` -> what
    was seen: each step's drafts, cached counts and q, and at the end each generator's state."""
    proposer = DraftModelProposer(draft, num_slots=3, max_len=128, confidence_threshold=threshold, head_ids=head_ids)
    assert proposer.native_chains
    proposer.native_chains = native
    proposer.cost = Observed()
    calls = []
    if native:
        original = draft.native.chains
        draft.native.chains = lambda *a: calls.append(1) or original(*a)
    rng = random.Random(7)
    seqs = [Seq(2, [5, 17, 33, 2, 9, 40, 41], params[0], seed=1), Seq(0, [7, 8, 9], params[1], seed=2)]
    proposer.read_prompt(seqs[:1])
    seqs[0].token_ids.append(11)  # the target's first token, which the draft has not read
    seen = []
    try:
        for step in range(steps):
            ks = [rng.randint(1, 4), rng.randint(0, 4) if step else 3]
            proposal = proposer._propose_chains(seqs, ks)
            flat, drafts = proposal.token_ids.tolist(), []
            for n in proposal.num_tokens:
                drafts.append(flat[:n])
                flat = flat[n:]
            accepted = [rng.randint(0, len(d)) for d in drafts]
            committed = [d[:a] + [rng.randrange(VOCAB)] for d, a in zip(drafts, accepted)]
            proposer.observe(seqs, SimpleNamespace(num_accepted=accepted, token_ids=committed))
            for s, t in zip(seqs, committed):
                s.token_ids += t
            # q over the vocabulary: the native chains' rows stay over a truncated head's ids
            assert proposal.probs_columns is None or (native and head_ids is not None)
            seen.append((drafts, list(proposer._cached), proposal.spread().probs))
    finally:
        if native:
            del draft.native.chains
    assert not native or len(calls) == (steps if calls_expected else 0)  # every step's chains went through the one call
    return seen, proposer.kv, proposer.cost.passes, [s.generator.get_state() for s in seqs]


def assert_same_drafting(draft: Decoder, threshold: float = 0.0, head_ids: torch.Tensor | None = None,
                         params: tuple[SamplingParams, SamplingParams] = (GREEDY, GREEDY)) -> list:
    native, kv_native, costs_native, gen_native = drive(draft, True, threshold, head_ids, params=params)
    python, kv_python, costs_python, gen_python = drive(draft, False, threshold, head_ids, params=params)
    for step, (a, b) in enumerate(zip(native, python, strict=True)):
        assert a[:2] == b[:2], f"step {step}: native {a[:2]}, python {b[:2]}"
        assert (a[2] is None) == (b[2] is None) and (a[2] is None or torch.equal(a[2], b[2])), f"step {step}'s q"
    assert all(torch.equal(x, y) for x, y in zip(gen_native, gen_python, strict=True))  # the generators drew alike
    for layer in range(draft.num_layers):
        assert torch.equal(kv_native.keys[layer], kv_python.keys[layer]), f"layer {layer}'s keys"
        assert torch.equal(kv_native.values[layer], kv_python.values[layer]), f"layer {layer}'s values"
    assert costs_native == costs_python
    return native


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_dense_tables(dtype):
    seen = assert_same_drafting(draft_model(dtype, None))
    assert any(len(d) > 1 for drafts, *_ in seen for d in drafts)  # chains of several passes were compared


@pytest.mark.parametrize("tables", TABLES, ids=["-".join(t) for t in TABLES])
def test_block_tables(tables):
    """The token table's rows come from C++'s own dequantization of each block format: a row that
    differed from numpy's by one bit would change the cache."""
    assert_same_drafting(draft_model(torch.bfloat16, tables))


@pytest.mark.parametrize("tables", [None, ("Q8_0", "Q4_K")], ids=["dense", "blocks"])
def test_truncated_head(tables):
    """A head of a subset of the vocabulary: its rows' argmax mapped back to vocabulary ids."""
    ids = torch.tensor(sorted(random.Random(3).sample(range(VOCAB), 72)), dtype=torch.long)
    seen = assert_same_drafting(draft_model(torch.bfloat16, tables, ids), head_ids=ids)
    assert {t for drafts, *_ in seen for d in drafts for t in d} <= set(ids.tolist())


def test_confidence_threshold_cuts_the_same_chains():
    seen = assert_same_drafting(draft_model(torch.float32, ("Q4_K", "Q6_K")), threshold=0.3)
    lengths = [len(d) for drafts, *_ in seen for d in drafts]
    assert 1 in lengths and max(lengths) > 1  # some chains were cut after their first token, not all


SAMPLED = [("f32-dense", torch.float32, None, False, 0.0), ("bf16-blocks", torch.bfloat16, ("Q8_0", "Q4_K"), False, 0.0),
           ("truncated", torch.bfloat16, ("Q4_K", "Q6_K"), True, 0.0), ("threshold", torch.float32, None, False, 0.05)]


@pytest.mark.parametrize("dtype, tables, truncated, threshold", [c[1:] for c in SAMPLED], ids=[c[0] for c in SAMPLED])
def test_sampled_chains(dtype, tables, truncated, threshold):
    """Sampled chains beside a greedy one: each token drawn with the uniform the Python loop would
    draw for it (kernels/rowwise.h's sampler in both), q handed on alike; with the threshold the
    chains cut short put back the uniforms they did not use."""
    ids = torch.tensor(sorted(random.Random(3).sample(range(VOCAB), 72)), dtype=torch.long) if truncated else None
    seen = assert_same_drafting(draft_model(dtype, tables, ids), threshold, ids, params=(WARM, GREEDY))
    q = [step[2] for step in seen if step[2] is not None]
    assert q and all(torch.allclose(x.sum(-1), torch.ones(x.shape[0])) for x in q)
    greedy_rows = [step[2][len(step[0][0]) :] for step in seen if step[2] is not None]  # the greedy sequence's one-hot rows
    assert all(torch.equal(r.max(-1).values, torch.ones(r.shape[0])) for r in greedy_rows)
    if threshold:
        lengths = [len(d) for drafts, *_ in seen for d in drafts]
        assert 1 in lengths and max(lengths) > 1


FILTERED = [("top_k", SamplingParams(max_tokens=64, temperature=0.8, top_k=7)),
            ("top_p", SamplingParams(max_tokens=64, temperature=1.3, top_p=0.6)),
            ("min_p", SamplingParams(max_tokens=64, temperature=1.0, min_p=0.2)),
            ("all", SamplingParams(max_tokens=64, temperature=0.9, top_k=40, top_p=0.8, min_p=0.05))]


@pytest.mark.parametrize("truncated", [False, True], ids=["full", "truncated"])
@pytest.mark.parametrize("params", [c[1] for c in FILTERED], ids=[c[0] for c in FILTERED])
def test_filtered_chains(params, truncated):
    """top-k, top-p and min-p draws in the one call, beside a plain sampled sequence: the Python
    loop's tokens and q (the kernels shape the rows in both), and q keeps only what the filters
    let through."""
    ids = torch.tensor(sorted(random.Random(3).sample(range(VOCAB), 72)), dtype=torch.long) if truncated else None
    seen = assert_same_drafting(draft_model(torch.bfloat16, ("Q4_K", "Q6_K"), ids), 0.0, ids, params=(params, WARM))
    kept = [int((row > 0).sum()) for step in seen if step[2] is not None for row in step[2][: len(step[0][0])]]
    assert kept and max(kept) < (72 if truncated else VOCAB)  # the filtered sequence's q rows
    if params.top_k:  # at most k tokens, or more where bfloat16 logits tie with the k-th
        assert sorted(kept)[len(kept) // 2] <= params.top_k
        if params.top_p == 1 and params.min_p == 0:
            assert min(kept) >= params.top_k


def test_an_empty_feed_is_refused_by_both_loops():
    """A sequence with nothing to read has no last row to draft from: the Python pass refuses it
    rather than hand it another sequence's logits, as the native call does."""
    from quickdraft.proposers.draft.load import draft_pass

    draft = draft_model(torch.bfloat16, None)
    proposer = DraftModelProposer(draft, num_slots=2, max_len=32)
    with pytest.raises(ValueError, match="at least one token"):
        draft_pass(draft, proposer.kv, [0, 1], [0, 0], [[], [1, 2]])
    with pytest.raises(RuntimeError, match="at least one token"):
        draft.native.chains(proposer.kv, [0, 1], [0, 0], [[], [1, 2]], [2, 2], 0.0)


def test_bad_arguments_are_refused():
    draft = draft_model(torch.bfloat16, ("Q4_0", "Q8_0"))
    proposer = DraftModelProposer(draft, num_slots=2, max_len=32)
    native = draft.native
    with pytest.raises(RuntimeError, match="past the table"):
        native.chains(proposer.kv, [0], [0], [[VOCAB]], [2], 0.0)
    with pytest.raises(RuntimeError, match="past the cache"):
        native.chains(proposer.kv, [0], [30], [[1, 2, 3]], [2], 0.0)
    with pytest.raises(RuntimeError, match="at least one token"):
        native.chains(proposer.kv, [0], [0], [[1]], [0], 0.0)
    with pytest.raises(RuntimeError, match="uniforms"):
        native.chains(proposer.kv, [0], [0], [[1]], [2], 0.0, [0.5], None)
    with pytest.raises(RuntimeError, match="temperature"):
        native.chains(proposer.kv, [0], [0], [[1]], [2], 0.0, [-1.0], torch.zeros(1, 2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="past the table"):
        native._model.set_head(draft.w["model.embed_tokens.weight"].data, 0, VOCAB, draft.lm_head.data, 3, VOCAB,
                               torch.tensor([VOCAB] * VOCAB))
