"""Drafts with another tokenizer (proposers/draft/retokenize.py, proposers/draft/text.py): the text
bridge unit by unit on the real SmolLM2 (draft) and Qwen2.5 (target) tokenizers, then end to end:
greedy output identical to plain decoding with a draft that agrees (the target itself, through
text), one that never does and one in between (SmolLM2-135M drafting for the Qwen2.5 0.5B), in a
batch, with the prefix cache on and off. bfloat16 is exact: the decoder is batch invariant."""

from __future__ import annotations


import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.config import SpeculativeConfig
from quickdraft.errors import ConfigError
from quickdraft.models.loader import load_model
from quickdraft.models.tiny import never_agreeing
from quickdraft.proposers.draft.retokenize import Bridge, common_prefix, complete_len


def test_complete_len():
    euro = "€".encode()  # 3 bytes
    assert complete_len(b"") == 0
    assert complete_len(b"abc") == 3
    assert complete_len(b"ab" + euro) == 5
    assert complete_len(b"ab" + euro[:1]) == 2 and complete_len(b"ab" + euro[:2]) == 2
    assert complete_len("é".encode()) == 2 and complete_len("é".encode()[:1]) == 0
    assert complete_len(b"a" + "😀".encode()[:3]) == 1 and complete_len(b"a" + "😀".encode()) == 5


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3], start=2) == 3
    assert common_prefix([], [1]) == 0


@pytest.fixture(scope="module")
def bridge(smollm2_tokenizer, qwen05_tokenizer):
    return Bridge(qwen05_tokenizer, smollm2_tokenizer)  # the target speaks Qwen's ids, the draft SmolLM2's


CHAT = "<|im_start|>user\nWrite a function that adds two numbers.<|im_end|>\n<|im_start|>assistant\ndef add(a, b):\n"


def grow(bridge, text: str, pieces: list[int]):
    """A view that follows the target's tokens of ``text`` arriving ``pieces`` tokens at a time."""
    target = bridge.target.encode(text)
    view, at = bridge.new_view(), 0
    for n in pieces + [len(target)]:
        at = min(len(target), at + n)
        bridge.follow(view, target[:at])
    return view, target


@pytest.mark.parametrize("pieces", [[1] * 40, [3, 7, 2, 11], [100]])
def test_the_view_is_the_drafts_own_tokenization(bridge, smollm2_tokenizer, pieces):
    """However the target's tokens arrive, the draft reads the whole text as it would encode it,
    the chat template's special tokens as its own special ids."""
    view, _ = grow(bridge, CHAT, pieces)
    assert view.ids == smollm2_tokenizer.encode(CHAT)
    assert view.ends[-1] == len(CHAT.encode()) and view.exact
    assert smollm2_tokenizer.token_to_id("<|im_start|>") in view.ids


def test_a_word_cut_at_the_end_is_encoded_again_and_its_keys_dropped(bridge, smollm2_tokenizer):
    """Where the target's tokens so far end inside a word the draft spells with other tokens once
    it is whole, the view's tail changes and the keys of the old tail go."""
    text = "def compute_average(values):\n    return sum(values) / len(values)\n"
    target, full = bridge.target.encode(text), smollm2_tokenizer.encode(text)
    cut = next(i for i in range(1, len(target))
               if (d := smollm2_tokenizer.encode(bridge.target_bytes(target[:i]).decode()))[: len(d)] != full[: len(d)])
    view = bridge.new_view()
    bridge.follow(view, target[:cut])
    old = list(view.ids)
    view.kv = old + [1, 2]  # as if the draft had read all of it and drafted two tokens
    bridge.follow(view, target)
    assert view.ids == full
    assert view.kv == full[: common_prefix(old, full)] and len(view.kv) < len(old)


def test_an_unfinished_character_waits_for_its_last_bytes(bridge, qwen05_tokenizer):
    """A target token that ends inside a UTF-8 character: the draft reads up to the character, and
    a proposal must start with the bytes already committed."""
    text = "x = '🦜'"
    ids = qwen05_tokenizer.encode(text)
    cut = next(i for i in range(1, len(ids)) if complete_len(bridge.target_bytes(ids[:i])) < len(bridge.target_bytes(ids[:i])))
    view = bridge.new_view()
    bridge.follow(view, ids[:cut])
    committed = bridge.target_bytes(ids[:cut])
    assert view.covered == complete_len(committed) < len(committed)
    # a proposal that does not continue the partial character is none; no target tokens spell the rest of one
    assert bridge.to_target(view, ids[:cut], bridge.draft.encode(" y")) == []
    assert bridge.to_target(view, ids[:cut], bridge.draft.encode("🦜'")) == ids[cut:]  # the rest of 🦜, then '
    bridge.follow(view, ids)
    assert view.covered == len(text.encode())


def test_proposals_become_the_targets_tokens(bridge, smollm2_tokenizer, qwen05_tokenizer):
    prefix = "def add(a, b):\n   "
    target = qwen05_tokenizer.encode(prefix)
    view = bridge.new_view()
    bridge.follow(view, target)
    full = qwen05_tokenizer.encode(prefix + " return a + b\n")
    assert full[: len(target)] == target
    draft = smollm2_tokenizer.encode(" return a + b\n")
    assert bridge.to_target(view, target, draft) == full[len(target) :]
    # the draft's end of turn is proposed as the target's own <|im_end|>
    end = smollm2_tokenizer.token_to_id("<|im_end|>")
    assert end in smollm2_tokenizer.eos_token_ids
    out = bridge.to_target(view, target, draft + [end])
    assert out == full[len(target) :] + [qwen05_tokenizer.token_to_id("<|im_end|>")]


def test_config_refuses_cross_tokenizer_outside_draft_model():
    with pytest.raises(ConfigError, match="cross_tokenizer"):
        SpeculativeConfig(method="ngram", cross_tokenizer=True)
    with pytest.raises(ConfigError, match="true or false"):
        SpeculativeConfig(method="draft_model", model="x", cross_tokenizer="yes")


# -- end to end (real weights: slow) -----------------------------------------------------------------------------------

PROMPTS = [
    "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName three colours. Ünïcödé ✓<|im_end|>\n<|im_start|>assistant\n",
]
PARAMS = SamplingParams(max_tokens=16, temperature=0)


def spec(draft, k=4):
    return {"method": "draft_model", "model": draft, "cross_tokenizer": True, "num_speculative_tokens": k,
            "adaptive": False, "quantization": None, "draft_confidence_threshold": 0.0}


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_model(str(smollm2_path), torch.bfloat16, quantization=None)  # dense: never_agreeing() rolls its head


@pytest.fixture(scope="module")
def qwen05(qwen05_path):
    return load_model(str(qwen05_path), torch.bfloat16)


def generate(target, spec_=None, prompts=PROMPTS, **kw):
    llm = LLM(target, speculative_config=spec_, dtype="bfloat16", max_num_seqs=4, **kw)
    outs = llm.generate(prompts, PARAMS)
    return [o.token_ids for o in outs], llm.engine.stats


@pytest.fixture(scope="module")
def plain_smollm2(smollm2):
    return generate(smollm2)[0]


@pytest.mark.slow
def test_the_target_as_its_own_draft_through_text(smollm2, plain_smollm2):
    """Same model, so the draft agrees wherever the text round trip gives the target's tokens."""
    plain = plain_smollm2
    outs, stats = generate(smollm2, spec(smollm2))
    assert outs == plain
    assert stats.acceptance_rate > 0.9 and stats.mean_accepted_length > 2.5


@pytest.mark.slow
def test_the_draft_reads_the_prompt_in_the_prompts_step(smollm2, plain_smollm2, trace_draft_passes):
    """As proposers/draft/model.py does: the draft reads its tokenization of each prompt in the
    prompt's step (engine._draft_reads_prompts), so that the first decoding step's draft pass
    reads a few tokens, not the whole prompt again; the output is still plain decoding's."""
    import quickdraft.proposers.draft.text as draft_text

    fed = trace_draft_passes(draft_text)
    engine = LLM(smollm2, speculative_config=spec(smollm2), dtype="bfloat16", max_num_seqs=4).engine
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    engine.step()  # the prompts' pass
    assert len(fed) == 1 and fed[0] == [len(p) - 1 for p in prompts]  # the target's tokens are the draft's here
    fed.clear()
    engine.step()
    assert max(fed[0]) <= 3  # the first draft pass of decoding: the views' last token and the target's new one
    outs = {}
    while engine.has_unfinished():
        outs |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert [outs[i] for i in ids] == plain_smollm2


@pytest.mark.slow
def test_a_draft_that_never_agrees(smollm2, plain_smollm2):
    plain = plain_smollm2
    outs, stats = generate(smollm2, spec(never_agreeing(smollm2)))
    assert outs == plain
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate < 0.1


@pytest.mark.slow
def test_smollm2_drafts_for_qwen(qwen05, smollm2):
    """Two vocabularies (49152 and 151936 ids); a refusal without cross_tokenizer."""
    with pytest.raises(ConfigError, match="cross_tokenizer"):
        LLM(qwen05, speculative_config={**spec(smollm2), "cross_tokenizer": False}, dtype="bfloat16")
    plain, _ = generate(qwen05, prompts=PROMPTS[:1])
    outs, stats = generate(qwen05, spec(smollm2), prompts=PROMPTS[:1])
    assert outs == plain
    assert 0.0 < stats.acceptance_rate < 1.0 and stats.mean_accepted_length > 1.5


@pytest.mark.slow
def test_the_prefix_cache_keeps_the_drafts_view(smollm2):
    """Two chat turns: the second reuses the first's keys, the draft's too (the counters are those
    of a run without the cache, so the draft read the same tokens)."""
    system = "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
    first = [system + p for p in PROMPTS]
    runs = {}
    for on in (False, True):
        llm = LLM(smollm2, speculative_config=spec(smollm2, 3), dtype="bfloat16", max_num_seqs=2,
                  max_model_len=512, enable_prefix_caching=on)
        outs = llm.generate(first, PARAMS)
        second = [p + o.text + "<|im_end|>\n<|im_start|>user\nShorter.<|im_end|>\n<|im_start|>assistant\n"
                  for p, o in zip(first, outs)]
        outs += llm.generate(second, PARAMS)
        proposer = llm.engine.runner.proposer
        runs[on] = [(o.token_ids, o.spec.num_draft_tokens, o.spec.num_accepted_tokens, o.num_cached_tokens)
                    for o in outs], [len(v.kv) for v in proposer.views]
    (off, _), (on, held) = runs[False], runs[True]
    assert [r[:3] for r in on] == [r[:3] for r in off]
    assert all(r[3] > 0 for r in on[2:]) and all(r[3] == 0 for r in off)
    assert all(n > 0 for n in held)
