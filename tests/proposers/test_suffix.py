"""The suffix structure of method "suffix" (proposers/lookup/suffix_tree.py) and its proposer
(proposers/lookup/suffix.py) without a model: counts, longest match, the most frequent path and its
min_prob cut, the adaptive length, bounded memory, persistence, and the config's errors."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from quickdraft.config import SpeculativeConfig
from quickdraft.errors import ConfigError
from quickdraft.proposers.lookup.suffix import SuffixCache, SuffixProposer
from quickdraft.proposers.lookup.suffix_tree import SuffixTrie


def counts(trie: SuffixTrie, path) -> tuple[int, int]:
    node = trie.find(path)
    return (trie.count[node], trie.total[node]) if node >= 0 else (0, 0)


def brute_counts(text: list[int], path: list[int], depth: int) -> tuple[int, int]:
    """(occurrences of path in text, those followed by a token within a window of depth)."""
    n = len(path)
    starts = [i for i in range(len(text) - n + 1) if text[i : i + n] == path]
    return len(starts), sum(1 for i in starts if i + n < len(text) and n < depth)


def test_counts_are_window_frequencies():
    text = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    trie = SuffixTrie(depth=4)
    trie.insert(text)
    assert counts(trie, [1, 2]) == (3, 3)  # followed by 3, 4 and 3
    assert counts(trie, [1, 2, 3]) == (2, 1)  # the second "1 2 3" ends the text
    assert counts(trie, [2, 4]) == (1, 1)
    assert counts(trie, [1, 2, 3, 1]) == (1, 0)  # depth 4: a window takes no fifth token
    assert counts(trie, [5]) == (0, 0)
    assert trie.total[trie.ROOT] == len(text)


@pytest.mark.parametrize("depth", [2, 3, 6])
def test_counts_match_brute_force_on_random_text(depth):
    rng = random.Random(depth)
    text = [rng.randrange(4) for _ in range(300)]
    trie = SuffixTrie(depth)
    open_nodes = []
    for a in range(0, len(text), 37):  # fed in pieces, as a sequence grows
        open_nodes = trie.extend(text[a : a + 37], open_nodes)
    for _ in range(200):
        n = rng.randrange(1, depth + 1)
        i = rng.randrange(len(text) - n + 1)
        path = text[i : i + n]
        assert counts(trie, path) == brute_counts(text, path, depth), path


def test_longest_match_needs_a_continuation():
    trie = SuffixTrie(depth=8)
    trie.insert([7, 1, 2, 3, 9, 5, 2, 3, 4])
    node, m = trie.match([0, 1, 2, 3], max_length=7)
    assert m == 3 and node == trie.find([1, 2, 3])
    assert trie.match([6, 2, 3], 7)[1] == 2  # "6 2 3" never occurs: "2 3" does, twice
    assert trie.match([3, 4], 7) == (-1, 0)  # "3 4" and "4" end the text: nothing follows them
    assert trie.match([1, 2, 3], max_length=2)[1] == 2  # capped


def test_most_frequent_path_and_min_prob_cut():
    trie = SuffixTrie(depth=8)
    for tail in ([10, 11, 12], [10, 11, 12], [10, 11, 13], [20, 21, 22]):
        trie.insert([1, 2] + tail)
    # after "1 2": 10 three times in four, then 11 always, then 12 two times in three
    tree = trie.draft_tree([5, 1, 2], max_match=7, max_nodes=8, min_prob=0.0)
    assert tree.chain() == [10, 11, 12] and tree.match_length == 2
    assert tree.probs == pytest.approx([0.75, 0.75, 0.5])
    assert trie.draft_tree([5, 1, 2], 7, 8, min_prob=0.6).chain() == [10, 11]  # 0.5 < 0.6: cut
    assert trie.draft_tree([5, 1, 2], 7, 8, min_prob=0.8).chain() == []
    assert trie.draft_tree([5, 1, 2], 7, 2, min_prob=0.0).chain() == [10, 11]  # at most max_nodes


def test_tree_holds_the_chain_and_the_runner_up():
    trie = SuffixTrie(depth=8)
    for tail in ([10, 11], [10, 11], [20, 21]):
        trie.insert([1, 2] + tail)
    tree = trie.draft_tree([1, 2], 7, max_nodes=4, min_prob=0.0, width=2)
    assert tree.chain() == [10, 11]
    edges = {(tree.tokens[p] if p >= 0 else None, t) for t, p in zip(tree.tokens, tree.parents)}
    assert edges == {(None, 10), (10, 11), (None, 20), (20, 21)}
    assert all(p < i for i, p in enumerate(tree.parents))  # parents come first
    assert tree.score == pytest.approx(2 / 3 + 2 / 3 + 1 / 3 + 1 / 3)


def test_speculation_length_follows_the_match_length():
    trie = SuffixTrie(depth=32)
    text = list(range(100, 120))
    trie.insert(text)
    for m in (1, 2, 4):  # a match of m tokens drafts factor * m
        assert len(trie.draft_tree(text[:m], 31, 16, 0.0, max_spec_factor=1.0).chain()) == m
        assert len(trie.draft_tree(text[:m], 31, 16, 0.0, max_spec_factor=2.0).chain()) == 2 * m
    assert len(trie.draft_tree(text[:8], 31, 5, 0.0, max_spec_factor=1.0).chain()) == 5  # and at most K


def test_remove_undoes_insert_and_frees_nodes():
    rng = random.Random(0)
    a, b = [rng.randrange(6) for _ in range(200)], [rng.randrange(6) for _ in range(150)]
    only_b = SuffixTrie(5)
    only_b.insert(b)
    trie = SuffixTrie(5)
    trie.insert(a)
    trie.insert(b)
    trie.remove(a)
    assert trie.num_nodes == only_b.num_nodes
    for _ in range(100):
        n = rng.randrange(1, 6)
        i = rng.randrange(len(b) - n + 1)
        assert counts(trie, b[i : i + n]) == counts(only_b, b[i : i + n])
    trie.remove(b)
    assert trie.num_nodes == 0 and trie.total[trie.ROOT] == 0 and trie.kids[trie.ROOT] == -1
    size = len(trie.token)
    trie.insert(a)  # freed nodes are reused
    assert len(trie.token) == size


def test_global_cache_evicts_the_oldest_by_requests_and_by_tokens():
    cache = SuffixCache(depth=4, max_requests=2, max_tokens=10)
    cache.add([1, 2, 3])
    cache.add([4, 5, 6])
    cache.add([7, 8, 9])  # three requests: [1, 2, 3] leaves
    assert list(cache.outputs) == [[4, 5, 6], [7, 8, 9]] and counts(cache.trie, [1]) == (0, 0)
    cache.add([10, 11, 12, 13, 14])  # 8 + 5 > 10 tokens: [4, 5, 6] leaves
    assert list(cache.outputs) == [[7, 8, 9], [10, 11, 12, 13, 14]] and cache.num_tokens == 8
    cache.add(list(range(20, 40)))  # longer than the bound alone: its last 10 tokens stay
    assert list(cache.outputs) == [list(range(30, 40))] and cache.num_tokens == 10
    fresh = SuffixTrie(4)
    fresh.insert(range(30, 40))
    assert cache.trie.num_nodes == fresh.num_nodes  # memory is the kept outputs' only
    off = SuffixCache(depth=4, max_requests=0, max_tokens=10)
    off.add([1, 2, 3])
    assert off.trie.num_nodes == 0


def seq(tokens: list[int], slot: int = 0, prompt_len: int | None = None):
    p = prompt_len if prompt_len is not None else len(tokens)
    return SimpleNamespace(prompt_token_ids=tokens[:p], output_token_ids=tokens[p:], token_ids=list(tokens), slot=slot)


def grow(s, tokens):
    s.output_token_ids += tokens
    s.token_ids = s.prompt_token_ids + s.output_token_ids


def test_proposer_drafts_from_its_own_text_and_follows_its_growth():
    prop = SuffixProposer(depth=16, min_prob=0.0)
    s = seq([5, 6, 7, 8, 9, 1, 5, 6])
    out = prop.propose([s], [4])
    assert out.token_ids.tolist() == [7, 8] and out.num_tokens == [2] and out.probs is None  # 2 matched: 2 drafted
    grow(s, [7])
    assert prop.propose([s], [4]).token_ids.tolist() == [8, 9, 1]  # 3 matched
    assert prop.propose([s], [0]).num_tokens == [0]


def test_proposer_drafts_from_a_finished_requests_output():
    prop = SuffixProposer(depth=16, min_prob=0.0)
    first = seq([1, 2, 3, 40, 41, 42, 43, 44, 45, 46], prompt_len=3)
    prop.propose([first], [4])
    prop.release(first)  # its output joins the global cache; its own trie goes
    assert prop._streams == {}
    second = seq([9, 9, 40, 41, 42], prompt_len=2, slot=0)
    assert prop.propose([second], [4]).token_ids.tolist() == [43, 44, 45]
    assert prop.cache.outputs[0] == [40, 41, 42, 43, 44, 45, 46]  # the output only, not the prompt


def test_persistence_round_trip(tmp_path):
    path = tmp_path / "sub" / "suffix.json"
    prop = SuffixProposer(depth=16, min_prob=0.0, cache_path=str(path), vocab_size=100)
    for i, out in enumerate(([40, 41, 42, 43, 44], [50, 51, 40, 41, 60], [40, 41, 42, 70])):
        prop.release(seq([1, 2] + out, slot=i, prompt_len=2))
    assert not path.exists()  # saved at close (or a minute after the last save), not on every request
    prop.close()
    saved = json.loads(path.read_text())
    assert saved["vocab_size"] == 100 and len(saved["outputs"]) == 3
    assert [p.name for p in path.parent.iterdir()] == ["suffix.json"]  # no temporary file left
    again = SuffixProposer(depth=16, min_prob=0.0, cache_path=str(path), vocab_size=100)
    for ctx in ([9, 40, 41], [51, 40], [40, 41, 42], [7]):
        a, b = prop.propose([seq([3] + ctx)], [6]), again.propose([seq([3] + ctx)], [6])
        assert a.token_ids.tolist() == b.token_ids.tolist()
    assert again.propose([seq([9, 40, 41])], [6]).token_ids.tolist() == [42, 43]


def test_a_damaged_or_foreign_cache_is_left_unread(tmp_path, caplog):
    path = tmp_path / "suffix.json"
    path.write_text("{not json")
    assert SuffixProposer(cache_path=str(path), vocab_size=100).cache.num_tokens == 0
    SuffixCache(24, 10, 100).save(path, vocab_size=100)
    path.write_text(path.read_text().replace('"outputs":[]', '"outputs":[[1,2,300]]'))
    assert SuffixProposer(cache_path=str(path), vocab_size=100).cache.num_tokens == 0
    cache = SuffixCache(24, 10, 100)
    cache.add([1, 2, 3])
    cache.save(path, vocab_size=100)
    assert SuffixProposer(cache_path=str(path), vocab_size=50000).cache.num_tokens == 0  # another vocabulary
    assert SuffixProposer(cache_path=str(path), vocab_size=100).cache.num_tokens == 3
    assert "not loaded" in caplog.text
    with pytest.raises(ConfigError, match="directory"):
        SuffixProposer(cache_path=str(tmp_path), vocab_size=100)


@pytest.mark.parametrize("key, value, words", [
    ("suffix_decoding_max_tree_depth", 1, "2..1024"),
    ("suffix_decoding_max_tree_depth", 4, "must exceed num_speculative_tokens"),
    ("suffix_decoding_max_spec_factor", 0, "> 0"),
    ("suffix_decoding_min_token_prob", 1.5, r"\[0, 1\]"),
    ("suffix_decoding_max_cached_requests", -1, ">= 0"),
    ("suffix_decoding_max_cached_tokens", "many", ">= 0"),
    ("suffix_decoding_cache_path", "", "file path"),
])
def test_config_errors_say_what_and_why(key, value, words):
    with pytest.raises(ConfigError, match=words) as e:
        SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 8, key: value})
    assert e.value.param == key and key in e.value.message


def test_config_reads_vllm_keys():
    spec = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 8, '
                                   '"suffix_decoding_max_tree_depth": 32, "suffix_decoding_min_token_prob": 0.2}')
    assert (spec.method, spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_min_token_prob) == ("suffix", 32, 0.2)


def test_a_tree_is_valued_by_its_paths_probability():
    """With branches, each node carries its path's empirical probability (never above its
    parent's), for the runner to trim the tree to the rows that pay (engine/plan.py, plan_tree_sizes)."""
    from quickdraft.sampling import SamplingParams

    prop = SuffixProposer(depth=16, min_prob=0.0, branches=3)
    s = seq([7, 1, 2, 3, 8, 1, 2, 3, 6, 1, 2, 4, 5, 1, 2])
    s.params = SamplingParams(temperature=0)
    out = prop.propose([s], [4])
    parents, values = out.tree(0), out.values[0]
    assert parents is not None and len(set(parents)) < len(parents)  # it branches
    assert len(values) == out.num_tokens[0]
    assert values[0] == pytest.approx(2 / 3)  # "1 2" was followed by 3 twice, by 4 once
    assert all(values[n] <= values[p] for n, p in enumerate(parents) if p >= 0)
