"""Statistical losslessness: what verify emits is distributed exactly as the target's samples.

The target and the draft are position-dependent Markov chains over V = 8 tokens (a fixed context:
the distribution at position j depends on j and on the token before it), so p_j and q_j differ at
every draft position and depend on the draft's own earlier tokens. N = 200k sequences run one
speculative step from position 0 (K = 3); the ones that emitted a single token run a second step
from position 1. The joint of the first two emitted tokens must match p_0(a) * p_1(b | a), and the
first token alone p_0, by a chi-square test (p-value > 1e-4). The same test must reject
deliberately wrong rules (p-value < 1e-4; they run on N / 4, and still score p-values that
underflow to 0), which shows that it has the power to catch a bug.

A truncated draft vocabulary (proposers/draft/vocab.py) runs through the same test: the draft
scores only a subset of the tokens, samples with the draft_model proposer's own functions, and
hands on q over the whole vocabulary with zeros outside the subset.
"""

import pytest
import torch

from quickdraft import sampling
from quickdraft.proposers.draft_sampling import sample_draft, to_vocab
from quickdraft.sampling import (BatchSampling, SamplingParams, draw_uniforms, head_columns, logits_to_probs,
                                 sample_from_probs)
from quickdraft.structured import apply_masks
from quickdraft.verify import rejection, verify

V, K, N = 8, 3, 200_000
ALPHA = 1e-4  # chi-square p-value threshold: the correct rule passes above it, wrong rules fall below


def markov_logits(seed: int) -> torch.Tensor:
    """Log-probabilities [K + 2, V, V]: row [j, a] is the distribution at position j after token a
    (Dirichlet(1) draws, fixed by ``seed``)."""
    e = -torch.rand(K + 2, V, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).log()
    return (e / e.sum(-1, keepdim=True)).log().float()


TARGET, DRAFT = markov_logits(1), markov_logits(2)


def shaped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> probs [n, V] with one request's params on every row."""
    batch = BatchSampling.from_params([params]).select(torch.zeros(logits.shape[0], dtype=torch.int64))
    return logits_to_probs(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p)


def truncated_draft(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator, subset: torch.Tensor,
                    full_q: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft_model proposer's sampling over a truncated head: logits [n, V] -> tokens [n] and
    q [n, V]. ``full_q``: the bug of handing on the untruncated distribution instead."""
    n = logits.shape[0]
    batch = BatchSampling.from_params([params]).select(torch.zeros(n, dtype=torch.int64))
    rows, q = sample_draft(logits[:, subset], batch, draw_uniforms(gen, n))
    tokens, q = to_vocab(rows, q, subset, V)
    return tokens, shaped(logits, params) if full_q else q


def speculative_step(pos: int, prev: torch.Tensor, params: SamplingParams, gen: torch.Generator,
                     point_mass: bool, pass_q: bool = True, subset: torch.Tensor | None = None,
                     full_q: bool = False, head_rows: bool = False) -> list[list[int]]:
    """One verify step for len(prev) sequences at position ``pos`` after tokens ``prev`` [n];
    ``subset``: the draft's truncated vocabulary; ``head_rows``: q handed on over the subset's
    rows with their columns (sampling.head_columns), as the draft's native chains hand it on."""
    n = prev.shape[0]
    ctx, target_rows, q_rows, draft = prev, [], [], []
    for j in range(K):
        target_rows.append(TARGET[pos + j][ctx])  # [n, V]
        if subset is not None:
            ctx, q = truncated_draft(DRAFT[pos + j][ctx], params, gen, subset, full_q)  # [n], [n, V]
            q_rows.append(q)
            draft.append(ctx)
            continue
        q = shaped(DRAFT[pos + j][ctx], params)  # [n, V]
        # Point-mass drafts guess deterministically, like an n-gram lookup.
        ctx = q.argmax(-1) if point_mass else sample_from_probs(q, draw_uniforms(gen, n))  # [n]
        q_rows.append(q)
        draft.append(ctx)
    target_rows.append(TARGET[pos + K][ctx])
    q_all = None if point_mass or not pass_q else torch.stack(q_rows, 1).reshape(n * K, V)
    out = verify(
        torch.stack(draft, 1).reshape(n * K),
        [K] * n,
        torch.stack(target_rows, 1).reshape(n * (K + 1), V),
        q_all[:, subset].contiguous() if head_rows else q_all,
        BatchSampling.from_params([params]).select(torch.zeros(n, dtype=torch.int64)),
        draw_uniforms(gen, n * (K + 1)),
        head_columns(subset, V) if head_rows else None,
    )
    return out.token_ids


def first_two_tokens(params: SamplingParams, point_mass: bool, seed: int, n: int = N,
                     pass_q: bool = True, **draft) -> torch.Tensor:
    """The first two emitted tokens [n, 2] of n independent generations (``draft``: the subset
    options of ``speculative_step``)."""
    gen = torch.Generator().manual_seed(seed)
    step1 = speculative_step(0, torch.zeros(n, dtype=torch.int64), params, gen, point_mass, pass_q, **draft)
    first = torch.tensor([t[0] for t in step1])
    second = torch.tensor([t[1] if len(t) > 1 else -1 for t in step1])
    again = (second < 0).nonzero().squeeze(1)
    step2 = speculative_step(1, first[again], params, gen, point_mass, pass_q, **draft)
    second[again] = torch.tensor([t[0] for t in step2], dtype=torch.int64)
    return torch.stack([first, second], 1)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` [C] against ``probs`` [C]. A count in a cell of
    probability 0 fails outright; cells expecting < 5 are pooled so the test stays valid."""
    counts, probs = counts.double(), probs.double() / probs.double().sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[small].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(obs.shape[0] - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def pvalues(tokens: torch.Tensor, params: SamplingParams) -> tuple[float, float]:
    """p-values of (first token vs p_0, joint of the first two vs p_0(a) p_1(b | a))."""
    p0 = shaped(TARGET[0][:1], params)[0]  # [V], context token 0
    p1 = shaped(TARGET[1], params)  # [V, V], row a: position 1 after a
    joint = (p0.double().unsqueeze(1) * p1.double()).reshape(V * V)  # [V * V]
    first = torch.bincount(tokens[:, 0], minlength=V)
    pairs = torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)
    return chi_square_pvalue(first, p0), chi_square_pvalue(pairs, joint)


CASES = {
    "sampled q": (SamplingParams(temperature=1.0), False),
    "top-k, top-p, temperature on both": (SamplingParams(temperature=0.8, top_k=5, top_p=0.85), False),
    "point-mass drafts": (SamplingParams(temperature=1.0), True),
    "point-mass drafts, shaped": (SamplingParams(temperature=1.3, top_k=6, top_p=0.9), True),
    "min_p on both": (SamplingParams(temperature=1.0, min_p=0.3), False),
    "point-mass drafts, min_p": (SamplingParams(temperature=1.2, min_p=0.2), True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_emitted_tokens_follow_the_target(name):
    params, point_mass = CASES[name]
    tokens = first_two_tokens(params, point_mass, seed=10)
    p_first, p_joint = pvalues(tokens, params)
    assert p_first > ALPHA and p_joint > ALPHA, (name, p_first, p_joint)


def test_sampled_drafts_verified_as_point_masses_stay_lossless():
    """Point-mass verification (accept x with probability p(x), else recover from p without x)
    is lossless for any proposal drawn independently of the verifier's uniforms:
    P(y) = q(y) p(y) + sum_{x != y} q(x) p(y) = p(y). So dropping q costs acceptance, not
    correctness; it is not one of the wrong rules below."""
    params, _ = CASES["sampled q"]
    tokens = first_two_tokens(params, False, seed=30, n=N // 2, pass_q=False)
    p_first, p_joint = pvalues(tokens, params)
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def accept_always(coins, p_draft, q_draft):
    return torch.ones_like(coins, dtype=torch.bool)


def inverted_ratio(coins, p_draft, q_draft):
    return coins < q_draft.double() / p_draft.double()


def recover_from_p(p, q):
    return p


WRONG_RULES = {
    "accept always": ("_accept_mask", accept_always, "sampled q"),
    "accept if u < q/p instead of p/q": ("_accept_mask", inverted_ratio, "sampled q"),
    "recover from p instead of max(0, p - q)": ("_recovery_probs", recover_from_p, "sampled q"),
    "recover from p, shaped": ("_recovery_probs", recover_from_p, "top-k, top-p, temperature on both"),
    "accept always, point-mass drafts": ("_accept_mask", accept_always, "point-mass drafts"),
}


@pytest.mark.parametrize("name", list(WRONG_RULES))
def test_wrong_rules_are_detected(monkeypatch, name):
    helper, wrong, case = WRONG_RULES[name]
    params, point_mass = CASES[case]
    # the wrong rule goes into torch's path (the CPU kernels' rule is held to it token for token:
    # tests/verify/test_sampling.py's test_the_kernels_rule_emits_the_torch_paths_tokens)
    monkeypatch.setattr(sampling, "row_kernels", lambda x: None)
    monkeypatch.setattr(rejection, helper, wrong)
    tokens = first_two_tokens(params, point_mass, seed=20, n=N // 4)
    p_first, p_joint = pvalues(tokens, params)
    assert min(p_first, p_joint) < ALPHA, (name, p_first, p_joint)


# Tokens 2, 5 and 7 are outside the draft's vocabulary: the target gives them mass at every
# position, so they can only come from recoveries and bonus tokens.
SUBSET = torch.tensor([0, 1, 3, 4, 6])
TRUNCATED = {
    "truncated draft vocabulary": SamplingParams(temperature=1.0),
    "truncated, top-k, top-p, temperature": SamplingParams(temperature=0.8, top_k=3, top_p=0.85),
}


@pytest.mark.parametrize("head_rows", [False, True], ids=["q spread", "q over the head's rows"])
@pytest.mark.parametrize("name", list(TRUNCATED))
def test_truncated_draft_vocabulary_follows_the_target(name, head_rows):
    params = TRUNCATED[name]
    tokens = first_two_tokens(params, False, seed=40, n=N // 2, subset=SUBSET, head_rows=head_rows)
    p_first, p_joint = pvalues(tokens, params)
    assert p_first > ALPHA and p_joint > ALPHA, (name, p_first, p_joint)
    outside = ~torch.isin(tokens, SUBSET)
    assert outside.any()  # the target's tokens outside the subset are emitted


def test_truncated_draft_with_untruncated_q_is_detected():
    """Sampling from the subset but handing on the draft's full-vocabulary q is wrong: the test sees it."""
    params = TRUNCATED["truncated draft vocabulary"]
    tokens = first_two_tokens(params, False, seed=50, n=N // 4, subset=SUBSET, full_q=True)
    p_first, p_joint = pvalues(tokens, params)
    assert min(p_first, p_joint) < ALPHA, (p_first, p_joint)


# Structured outputs (quickdraft/structured.py): a grammar's mask depends on the position and the
# token before it, like the chains. The draft samples from its unmasked q, is cut before its first
# token the mask rejects, and every target row is masked with the grammar's state after the drafts
# before that row (structured.apply_masks, the runner's own function). What comes out must follow
# the masked target.
GRAMMAR = torch.rand(K + 2, V, V, generator=torch.Generator().manual_seed(3)) < 0.55  # [position, before, token]
GRAMMAR[..., 4] = True  # every state allows something


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    apply_masks(out, allowed, ())
    return out


def grammar_step(pos: int, prev: torch.Tensor, params: SamplingParams, gen: torch.Generator,
                 advance: bool = True) -> list[list[int]]:
    """One verify step with a grammar; ``advance=False`` is the bug of masking every row with the
    state before the draft (a matcher that was not advanced over the draft tokens)."""
    n = prev.shape[0]
    ctx, draft, rows, ok = prev, [], [], torch.ones(n, dtype=torch.bool)
    keep = []
    for j in range(K):
        rows.append(masked(TARGET[pos + j][ctx], GRAMMAR[pos + (j if advance else 0)][ctx if advance else prev]))
        nxt = sample_from_probs(shaped(DRAFT[pos + j][ctx], params), draw_uniforms(gen, n))  # unmasked q
        ok = ok & GRAMMAR[pos + j][ctx, nxt]  # cut before the first token the grammar rejects
        keep.append(ok)
        draft.append(nxt)
        ctx = torch.where(ok, nxt, ctx)
    rows.append(masked(TARGET[pos + K][ctx], GRAMMAR[pos + (K if advance else 0)][ctx if advance else prev]))
    keep = torch.stack(keep, 1)  # [n, K]
    num = keep.sum(1)  # [n]
    row_keep = torch.cat([torch.ones(n, 1, dtype=torch.bool), keep], 1)  # [n, K + 1]
    out = verify(
        torch.stack(draft, 1)[keep], num.tolist(), torch.stack(rows, 1)[row_keep], None,
        BatchSampling.from_params([params]).select(torch.zeros(n, dtype=torch.int64)),
        draw_uniforms(gen, int(num.sum()) + n),
    )
    return out.token_ids


def grammar_pvalues(params: SamplingParams, seed: int, n: int, advance: bool = True) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(seed)
    step1 = grammar_step(0, torch.zeros(n, dtype=torch.int64), params, gen, advance)
    first = torch.tensor([t[0] for t in step1])
    second = torch.tensor([t[1] if len(t) > 1 else -1 for t in step1])
    again = (second < 0).nonzero().squeeze(1)
    second[again] = torch.tensor([t[0] for t in grammar_step(1, first[again], params, gen, advance)], dtype=torch.int64)
    p0 = shaped(masked(TARGET[0][:1], GRAMMAR[0][:1]), params)[0]  # [V]
    p1 = shaped(masked(TARGET[1], GRAMMAR[1]), params)  # [V, V]
    joint = (p0.double().unsqueeze(1) * p1.double()).reshape(V * V)
    return (chi_square_pvalue(torch.bincount(first, minlength=V), p0),
            chi_square_pvalue(torch.bincount(first * V + second, minlength=V * V), joint))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4, top_p=0.9)],
                         ids=["plain", "shaped"])
def test_grammar_masked_target_is_followed(params):
    p_first, p_joint = grammar_pvalues(params, seed=60, n=N // 2)
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def test_grammar_not_advanced_over_drafts_is_detected():
    p_first, p_joint = grammar_pvalues(SamplingParams(temperature=1.0), seed=70, n=N // 4, advance=False)
    assert min(p_first, p_joint) < ALPHA, (p_first, p_joint)
