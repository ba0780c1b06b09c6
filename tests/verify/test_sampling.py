"""Rejection-sampling path of verify: hand cases, edge uniforms, seeded reproducibility, shapes."""

import math

import pytest
import torch

from quickdraft.sampling import BatchSampling, SamplingParams, draw_uniforms, make_generator, sample_from_probs
from quickdraft.verify import verify
from quickdraft.verify.rejection import _recovery_probs

SAMPLED = SamplingParams(temperature=1.0)
EDGE = math.nextafter(1.0, 0.0)


def test_k_zero_is_plain_sampling_with_the_one_uniform():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    uniforms = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    out = verify(torch.zeros(0, dtype=torch.int64), [0, 0, 0], logits, None,
                 BatchSampling.from_params([SAMPLED] * 3), uniforms)
    assert [t[0] for t in out.token_ids] == sample_from_probs(torch.softmax(logits, -1), uniforms).tolist()
    assert out.num_accepted == [0, 0, 0]


def test_k_zero_batches_draw_as_the_general_path():
    """No sequence drafting (verify's plain-sampling path): greedy, temperature, top-p and top-k rows
    give the tokens the general path gives the same rows beside a sequence that drafts."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen) * 2
    params = [SAMPLED, SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_p=0.8),
              SamplingParams(temperature=1.3, top_k=5)]
    for trial in range(20):
        uniforms = torch.rand(4, generator=gen, dtype=torch.float64)
        out = verify(torch.zeros(0, dtype=torch.int64), [0] * 4, logits, None, BatchSampling.from_params(params), uniforms)
        general = verify(torch.tensor([7]), [0, 0, 0, 0, 1], torch.cat([logits, torch.randn(2, 50, generator=gen)]), None,
                         BatchSampling.from_params(params + [SAMPLED]),
                         torch.cat([uniforms, torch.tensor([0.5, 0.5], dtype=torch.float64)]))
        assert out.token_ids == general.token_ids[:4] and out.num_accepted == [0] * 4, trial


def test_acceptance_is_strict_u_below_p_over_q():
    """p(x) = 0 is rejected even at u = 0; p(x) >= q(x) is accepted even at u = 1 - eps."""
    logits = torch.tensor([[0.0, float("-inf"), 0.0], [0.0, 0.0, 0.0]])
    q = torch.tensor([[0.2, 0.6, 0.2]])
    out = verify(torch.tensor([1]), [1], logits, q, BatchSampling.from_params([SAMPLED]),
                 torch.tensor([0.0, 0.0], dtype=torch.float64))
    assert out.num_accepted == [0] and out.token_ids[0] != [1]
    out = verify(torch.tensor([0]), [1], logits, q, BatchSampling.from_params([SAMPLED]),
                 torch.tensor([EDGE, EDGE], dtype=torch.float64))
    assert out.num_accepted == [1] and out.token_ids[0][0] == 0


def test_point_mass_recovery_never_repeats_the_rejected_token():
    """q = one-hot(x): max(0, p - q) is p with x zeroed out."""
    gen = torch.Generator().manual_seed(1)
    batch, vocab = 400, 5
    logits = torch.randn(2 * batch, vocab, generator=gen)
    draft = torch.randint(vocab, (batch,), generator=gen)
    out = verify(draft, [1] * batch, logits, None, BatchSampling.from_params([SAMPLED] * batch),
                 torch.rand(2 * batch, generator=gen, dtype=torch.float64))
    rejected = [i for i, n in enumerate(out.num_accepted) if n == 0]
    assert 50 < len(rejected) < batch
    assert all(out.token_ids[i][0] != int(draft[i]) for i in rejected)


def test_recovered_token_is_drawn_with_the_last_uniform():
    """Rejecting x_0 = 1 (p = 0.1 < u = 0.5 < q = 0.6) recovers from (0.3, 0, 0.2, 0) with u_final."""
    p = torch.tensor([[0.5, 0.1, 0.4, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.6, 0.2, 0.0]])
    for final_u, expected in [(0.1, 0), (0.59, 0), (0.61, 2), (EDGE, 2)]:
        uniforms = torch.tensor([0.5, final_u], dtype=torch.float64)
        out = verify(torch.tensor([1]), [1], p.log(), q, BatchSampling.from_params([SAMPLED]), uniforms)
        assert out.token_ids == [[expected]] and out.num_accepted == [0]


def test_zero_mass_residual_falls_back_to_p():
    p = torch.tensor([[0.2, 0.3, 0.0], [0.5, 0.2, 0.3]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.8, 0.1]])
    out = _recovery_probs(p, q)
    assert torch.equal(out[0], p[0])
    assert torch.allclose(out[1], torch.tensor([0.4, 0.0, 0.2]))


def seeded_run(seed: int, batch: int = 64, k: int = 3, vocab: int = 6):
    """A batch whose outcome depends on every uniform, with uniforms from one seeded generator."""
    cases = torch.Generator().manual_seed(99)
    logits = torch.randn(batch * (k + 1), vocab, generator=cases)
    q = torch.softmax(torch.randn(batch * k, vocab, generator=cases), -1)
    uniforms = draw_uniforms(make_generator(seed), batch * (k + 1))
    draft = sample_from_probs(q, draw_uniforms(make_generator(seed + 1000), batch * k))
    params = BatchSampling.from_params([SamplingParams(temperature=0.9, top_p=0.95)] * batch)
    return uniforms, verify(draft, [k] * batch, logits, q, params, uniforms)


def test_seeded_runs_are_reproducible():
    u1, out1 = seeded_run(7)
    u2, out2 = seeded_run(7)
    u3, out3 = seeded_run(8)
    assert torch.equal(u1, u2) and out1 == out2
    assert not torch.equal(u1, u3) and out1 != out3


def test_per_request_generators_concatenate():
    """The runner draws K_i + 1 uniforms from each request's own generator and concatenates them."""
    logits = torch.randn(7, 9, generator=torch.Generator().manual_seed(3))
    draft, num_draft = torch.tensor([1, 2, 3, 4]), [3, 0, 1]
    params = BatchSampling.from_params([SAMPLED] * 3)

    def run():
        gens = [make_generator(s) for s in (11, 12, 13)]
        uniforms = torch.cat([draw_uniforms(g, k + 1) for g, k in zip(gens, num_draft)])
        return verify(draft, num_draft, logits, None, params, uniforms)

    assert run() == run()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(draft=torch.tensor([1, 2])), "draft_token_ids"),
        (dict(logits=torch.zeros(4, 5)), "target_logits"),
        (dict(q=torch.zeros(3, 4)), "draft_probs"),
        (dict(uniforms=torch.zeros(4, dtype=torch.float64)), "uniforms"),
        (dict(params=BatchSampling.from_params([SAMPLED])), "sampling"),
        (dict(num_draft=[-1, 4]), "num_draft_tokens"),
    ],
)
def test_shape_errors_name_the_argument(change, message):
    args = dict(draft=torch.tensor([1, 2, 3]), num_draft=[2, 1], logits=torch.zeros(5, 5), q=None,
                params=BatchSampling.from_params([SAMPLED] * 2), uniforms=torch.zeros(5, dtype=torch.float64))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        verify(args["draft"], args["num_draft"], args["logits"], args["q"], args["params"], args["uniforms"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["q", "point-masses", "head"])
def test_the_kernels_rule_emits_the_torch_paths_tokens(monkeypatch, dtype, kind):
    """On the CPU verify runs the rule in the kernels (kernels/verify.cpp's verify_chains), shaping a
    target row only once the drafts before it were accepted; torch's path (CUDA's) shapes them
    all. Both emit the same tokens, batch after batch: greedy, temperature, top-k, top-p and
    min-p sequences side by side, chains of 0 to 5 drafts, drafts the target likes (accepted)
    and ones it does not (recovered), with q, as point masses, or with q over a truncated draft
    head's rows alone (``draft_columns``: the kernels read it as it is, and emit what they emit
    for the same q spread over the vocabulary)."""
    from quickdraft import sampling

    if sampling.row_kernels(torch.zeros(1, 1)) is None:
        pytest.skip("the CPU kernels are not available here")
    gen = torch.Generator().manual_seed(11)
    vocab = 300
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=20),
              SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.1),
              SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02)]
    seen = set()
    for trial in range(60):
        ks = torch.randint(0, 6, (len(params),), generator=gen).tolist()
        logits = (torch.randn(sum(ks) + len(ks), vocab, generator=gen) * 3).to(dtype)
        q_logits = logits[[r for i, k in enumerate(ks) for r in range(sum(ks[:i]) + i, sum(ks[:i]) + i + k)]].float()
        q_logits += torch.randn(q_logits.shape, generator=gen) * (0.5 if trial % 2 else 3.0)  # a close draft, a poor one
        ids = None
        if kind == "head":  # the draft's head holds 200 of the 300 ids, in an order of its own
            ids = torch.randperm(vocab, generator=gen)[:200]
            outside = torch.ones(vocab, dtype=torch.bool)
            outside[ids] = False
            q_logits[:, outside] = -torch.inf
        batch = BatchSampling.from_params(params)
        per_draft = batch.select(torch.repeat_interleave(torch.arange(len(ks)), torch.tensor(ks)))
        q = sampling.logits_to_probs(q_logits, per_draft.temperature, per_draft.top_k, per_draft.top_p, per_draft.min_p)
        drafts = sampling.sample_from_probs(q, torch.rand(q.shape[0], generator=gen, dtype=torch.float64))
        uniforms = torch.rand(sum(ks) + len(ks), generator=gen, dtype=torch.float64)
        given = None if kind == "point-masses" else q if ids is None else q[:, ids].contiguous()
        columns = None if ids is None else sampling.head_columns(ids, vocab)
        args = (drafts, ks, logits, given, batch, uniforms, columns)
        native = verify(*args)
        with monkeypatch.context() as m:
            m.setattr(sampling, "row_kernels", lambda x: None)
            python = verify(*args)
        assert native.token_ids == python.token_ids and native.num_accepted == python.num_accepted, trial
        if ids is not None:
            spread = verify(drafts, ks, logits, q, batch, uniforms)
            assert native.token_ids == spread.token_ids and native.num_accepted == spread.num_accepted, trial
        # each sequence alone, as a single request's steps verify it: its rows prepared two at a time
        # on two threads (verify_chains' verify_one), the row after a draft beside the draft's own
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            for i, k in enumerate(ks):
                d0, r0 = sum(ks[:i]), sum(ks[:i]) + i
                alone = verify(drafts[d0 : d0 + k], [k], logits[r0 : r0 + k + 1], None if given is None else given[d0 : d0 + k],
                               BatchSampling.from_params([params[i]]), uniforms[r0 : r0 + k + 1], columns)
                assert (alone.token_ids[0], alone.num_accepted[0]) == (native.token_ids[i], native.num_accepted[i]), (trial, i)
        finally:
            torch.set_num_threads(threads)
        seen.update((n > 0, n < k) for n, k in zip(native.num_accepted, ks) if k)
    assert seen == {(False, True), (True, True), (True, False)}  # rejected first, part accepted, all accepted
