"""Token-tree verification (quickdraft/verify/tree.py), in the layers the chain verifier is tested in:
exact greedy cases on hand-built trees, the fast rule against the slow reference draw for draw, a
chain-shaped tree against the chain verifier, and a statistical test with the power to reject
deliberately wrong rules."""

import pytest
import torch

from quickdraft.sampling import BatchSampling, SamplingParams, draw_uniforms, logits_to_probs, sample_from_probs
from quickdraft.verify import tree as tree_module
from quickdraft.verify import verify
from quickdraft.verify.reference import reference_verify_tree
from quickdraft.verify.tree import DraftTree, verify_tree

from tests.verify.test_statistics import chi_square_pvalue

GREEDY = SamplingParams(temperature=0.0)


def one_hot_rows(argmax: list[int], vocab: int = 6) -> torch.Tensor:
    """Logits [len(argmax), vocab] whose row j has its maximum at argmax[j]."""
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def test_greedy_follows_the_matching_branch_and_adds_the_bonus():
    # root -> {node 0: 3, node 1: 4}; node 1 -> {node 2: 1, node 3: 2}; node 3 -> {node 4: 5}
    tree = DraftTree(torch.tensor([3, 4, 1, 2, 5]), [-1, -1, 1, 1, 3])
    # rows: root, node 0, ..., node 4; the argmax after the root is 4 (node 1), after node 1 it is
    # 2 (node 3), after node 3 5 (node 4), after node 4 0 (the bonus token)
    logits = one_hot_rows([4, 0, 2, 0, 5, 0])
    out = verify_tree(tree, logits, GREEDY, torch.zeros(6, dtype=torch.float64))
    assert out.path == [1, 3, 4] and out.token_ids == [4, 2, 5, 0]


def test_greedy_without_a_matching_child_emits_the_argmax():
    tree = DraftTree(torch.tensor([3, 4]), [-1, -1])
    out = verify_tree(tree, one_hot_rows([1, 0, 0]), GREEDY, torch.zeros(3, dtype=torch.float64))
    assert out.path == [] and out.token_ids == [1]


def test_greedy_takes_the_first_of_repeated_siblings():
    tree = DraftTree(torch.tensor([2, 2, 0]), [-1, -1, 1])  # only node 1 has a child
    out = verify_tree(tree, one_hot_rows([2, 3, 0, 4]), GREEDY, torch.zeros(4, dtype=torch.float64))
    assert out.path == [0] and out.token_ids == [2, 3]


def test_a_tree_must_be_in_topological_order():
    with pytest.raises(ValueError, match="parent"):
        DraftTree(torch.tensor([1, 2]), [1, -1])


def random_tree(gen: torch.Generator, vocab: int, n: int, mode: str) -> DraftTree:
    """A random tree of n nodes whose siblings are drawn from one q per parent: i.i.d.
    ("replacement"), without replacement ("without") or as distinct point masses ("point")."""
    parents = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]
    q_rows = torch.rand(n + 1, vocab, generator=gen, dtype=torch.float64) ** 3
    q_rows /= q_rows.sum(-1, keepdim=True)
    tokens, probs, taken = [], [], {}
    for i, parent in enumerate(parents):
        q = q_rows[parent + 1].clone()
        if mode != "replacement":
            for x in taken.get(parent, []):
                q[x] = 0.0
        if q.sum() == 0:  # every token taken: repeat one (allowed; it can never be accepted twice)
            q = q_rows[parent + 1].clone()
        x = int(sample_from_probs(q.unsqueeze(0), torch.rand(1, generator=gen, dtype=torch.float64))[0])
        taken.setdefault(parent, []).append(x)
        tokens.append(x)
        probs.append(q_rows[parent + 1].float())
    return DraftTree(torch.tensor(tokens), parents, None if mode == "point" else torch.stack(probs),
                     replacement=mode == "replacement")


@pytest.mark.parametrize("mode", ["replacement", "without", "point"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
                                    SamplingParams(temperature=0.0)])
def test_fast_rule_matches_the_reference_draw_for_draw(mode, params):
    gen = torch.Generator().manual_seed(7)
    vocab = 7
    for case in range(150):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        tree = random_tree(gen, vocab, n, mode)
        logits = torch.randn(n + 1, vocab, generator=gen) * 2
        uniforms = draw_uniforms(gen, n + 1)
        out = verify_tree(tree, logits, params, uniforms)
        tokens, path = reference_verify_tree(tree.token_ids.tolist(), tree.parents, logits, tree.probs, params,
                                             uniforms, replacement=tree.replacement)
        assert (out.token_ids, out.path) == (tokens, path), (mode, case)


@pytest.mark.parametrize("point", [False, True])
def test_a_chain_shaped_tree_is_the_chain_verifier(point):
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.9, top_k=6)
    vocab, k = 9, 4
    for _ in range(100):
        logits = torch.randn(k + 1, vocab, generator=gen)
        q = torch.softmax(torch.randn(k, vocab, generator=gen), -1)
        drafts = sample_from_probs(q, draw_uniforms(gen, k))
        uniforms = draw_uniforms(gen, k + 1)
        tree = DraftTree(drafts, [i - 1 for i in range(k)], None if point else q)
        chain = verify(drafts, [k], logits, None if point else q, BatchSampling.from_params([params]), uniforms)
        out = verify_tree(tree, logits, params, uniforms)
        assert out.token_ids == chain.token_ids[0] and out.num_accepted == chain.num_accepted[0]


# The statistical test: position-dependent Markov target and draft over V tokens (as
# test_statistics.py), a tree of WIDTH children per node and depth 2 from each context.
V, WIDTH, N = 5, 2, 8_000  # the wrong rules score p < 1e-19 at 6000
ALPHA = 1e-4


def markov(seed: int) -> torch.Tensor:
    e = -torch.rand(4, V, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).log()
    return (e / e.sum(-1, keepdim=True)).log().float()


TARGET, DRAFT = markov(11), markov(12)


def shaped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    rows = BatchSampling.from_params([params]).select(torch.zeros(logits.shape[0], dtype=torch.int64))
    return logits_to_probs(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p)


def draft_tables(params: SamplingParams) -> torch.Tensor:
    """The draft's shaped q [positions, V (previous token), V], computed once per case."""
    return torch.stack([shaped(DRAFT[pos], params) for pos in range(DRAFT.shape[0])])


def draw_children(q: torch.Tensor, mode: str, coins: list[float]) -> list[int]:
    """WIDTH children of a node whose draft distribution is q [V], with WIDTH uniforms."""
    if mode == "point":  # a lookup's distinct guesses: the draft's most likely tokens
        return q.topk(WIDTH).indices.tolist()
    out, weights = [], q.double().tolist()
    for u in coins:
        point, acc = u * sum(weights), 0.0
        x = next((v for v, w in enumerate(weights) if w > 0 and (acc := acc + w) > point),
                 max(v for v, w in enumerate(weights) if w > 0))
        out.append(x)
        if mode == "without":
            weights[x] = 0.0
    return out


def tree_step(pos: int, prev: int, params: SamplingParams, mode: str, q: torch.Tensor,
              gen: torch.Generator) -> list[int]:
    """One verification of a depth-2 tree drafted at position ``pos`` after token ``prev``."""
    coins = draw_uniforms(gen, WIDTH * (WIDTH + 1)).tolist()
    tokens, parents, probs, rows = [], [], [], [TARGET[pos][prev]]
    q0 = q[pos][prev]
    for x in draw_children(q0, mode, coins[:WIDTH]):
        tokens.append(x), parents.append(-1), probs.append(q0), rows.append(TARGET[pos + 1][x])
    for parent in range(WIDTH):
        q1 = q[pos + 1][tokens[parent]]
        for x in draw_children(q1, mode, coins[WIDTH * (parent + 1) : WIDTH * (parent + 2)]):
            tokens.append(x), parents.append(parent), probs.append(q1), rows.append(TARGET[pos + 2][x])
    tree = DraftTree(torch.tensor(tokens), parents, None if mode == "point" else torch.stack(probs),
                     replacement=mode == "replacement")
    return verify_tree(tree, torch.stack(rows), params, draw_uniforms(gen, len(tokens) + 1)).token_ids


def first_two(params: SamplingParams, mode: str, seed: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, pairs = draft_tables(params), []
    for _ in range(n):
        out = tree_step(0, 0, params, mode, q, gen)
        if len(out) == 1:
            out = out + tree_step(1, out[0], params, mode, q, gen)
        pairs.append(out[:2])
    return torch.tensor(pairs)


def pvalues(pairs: torch.Tensor, params: SamplingParams) -> tuple[float, float]:
    p0 = shaped(TARGET[0][:1], params)[0].double()
    p1 = shaped(TARGET[1], params).double()
    first = torch.bincount(pairs[:, 0], minlength=V)
    joint = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    return chi_square_pvalue(first, p0), chi_square_pvalue(joint, (p0.unsqueeze(1) * p1).reshape(-1))


CASES = {
    "siblings without replacement": (SamplingParams(temperature=1.0), "without"),
    "siblings i.i.d.": (SamplingParams(temperature=1.0), "replacement"),
    "point-mass siblings": (SamplingParams(temperature=1.0), "point"),
    "without replacement, shaped": (SamplingParams(temperature=0.8, top_k=4, top_p=0.9), "without"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tree_output_follows_the_target(name):
    params, mode = CASES[name]
    p_first, p_joint = pvalues(first_two(params, mode, seed=5, n=N), params)
    assert p_first > ALPHA and p_joint > ALPHA, (name, p_first, p_joint)


WRONG = {
    "residual not updated after a rejected child": ("_residual", lambda r, q: r, "siblings without replacement"),
    "a rejected sibling left in q (without replacement)": ("_without", lambda q, x: q, "siblings without replacement"),
    "point masses: residual not updated": ("_residual", lambda r, q: r, "point-mass siblings"),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_wrong_tree_rules_are_detected(monkeypatch, name):
    helper, wrong, case = WRONG[name]
    params, mode = CASES[case]
    monkeypatch.setattr(tree_module, helper, wrong)
    p_first, p_joint = pvalues(first_two(params, mode, seed=6, n=N), params)
    assert min(p_first, p_joint) < ALPHA, (name, p_first, p_joint)


def test_the_kv_cache_keeps_the_accepted_path_in_place():
    from quickdraft.models.kv_cache import KVCache
    from quickdraft.models.tiny import tiny_config

    config = tiny_config()
    kv = KVCache(config, num_slots=2, max_len=32, dtype=torch.float32)
    for layer in range(config.num_layers):
        kv.keys[layer].normal_()
        kv.values[layer].normal_()
    before = [t.clone() for t in (*kv.keys, *kv.values)]
    start, path = 5, [1, 3, 4]  # a tree of 6 nodes at positions 5..10; nodes 1, 3, 4 accepted
    kv.keep_path(1, start, path)
    for old, new in zip(before, (*kv.keys, *kv.values)):
        assert torch.equal(new[1, :, :start], old[1, :, :start])  # the context is untouched
        assert torch.equal(new[1, :, start : start + 3], old[1, :, [start + i for i in path]])
        assert torch.equal(new[0], old[0])  # other slots too
