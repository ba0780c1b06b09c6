"""Echo and logprobs as evaluation harnesses read them, checked against a teacher-forced pass of
the same model in this process.

lm-evaluation-harness scores a continuation by sending context + continuation as the prompt with
``echo``, ``logprobs: 1`` and ``max_tokens: 1``, and summing ``token_logprobs[ctxlen:-1]``: it
takes the last entry to be the generated token's, end of sequence included."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from qd_server import MODEL

from quickdraft.models.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.models.loader import load_model

pytestmark = pytest.mark.slow

C = "/v1/completions"
CHAT_HEAD = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# (context, continuation): the first two end where SmolLM2 ends its turn next (end of sequence)
PAIRS = [
    (CHAT_HEAD.format("Say OK."), "OK."),
    (CHAT_HEAD.format("Hi"), "Hello! How can I help you today?"),
    ("The capital of France is", " Paris"),
    ("One, two, three,", " four"),
    ("Question: How many legs does a spider have?\nAnswer:", " 18"),
]


@pytest.fixture(scope="module")
def teacher(smollm2_path):
    """ids -> [len(ids), vocab] log-probabilities of the next token at each position, from one
    prefill pass of SmolLM2 in float32 (what the server runs)."""
    model = load_model(MODEL, torch.float32)
    decoder = Decoder(model.config, model.weights)

    def log_probs(ids: list[int]) -> torch.Tensor:
        kv = KVCache(decoder.config, 1, len(ids), decoder.dtype, decoder.device)
        meta = AttentionMetadata.chain([0], [0], [len(ids)])
        hidden = decoder.forward(torch.tensor(ids), meta.positions(decoder.device), kv, meta)
        return torch.log_softmax(decoder.logits(hidden).float(), -1)

    return log_probs


def _post(server, body: dict) -> dict:
    r = httpx.post(server.url + C, json={"model": MODEL, "temperature": 0, **body}, headers=server.headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, body: dict) -> list[dict]:
    r = httpx.post(server.url + C, json={"model": MODEL, "temperature": 0, "stream": True, **body},
                   headers=server.headers, timeout=120)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _joined(chunks: list[dict]) -> dict:
    """The streamed choice's logprobs, its chunks' lists joined."""
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    return {k: [x for p in parts for x in p[k]] for k in parts[0]}


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def test_loglikelihoods_equal_teacher_forcing(edge_server, smollm2_tokenizer, teacher):
    """lm-evaluation-harness's request for each pair: every entry of ``token_logprobs`` is the
    teacher-forced logprob of that token, the end of sequence's included (it is the last entry,
    counted in completion_tokens), so ``sum(token_logprobs[ctxlen:-1])`` is the continuation's
    loglikelihood."""
    eos_seen = eos_argmax = 0
    for context, continuation in PAIRS:
        ctx = _ids(smollm2_tokenizer, context)
        ids = _ids(smollm2_tokenizer, context + continuation)
        out = _post(edge_server, {"prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "return_token_ids": True})
        choice, usage = out["choices"][0], out["usage"]
        lp = choice["logprobs"]
        assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 1
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        want = teacher(ids)  # [len(ids), vocab]
        eos_argmax += int(want[-1].argmax()) in smollm2_tokenizer.eos_token_ids
        stopped = choice["finish_reason"] == "stop"
        generated = smollm2_tokenizer.token_to_id(lp["tokens"][-1]) if stopped else choice["token_ids"][0]
        expected = [want[i - 1, ids[i]].item() for i in range(1, len(ids))] + [want[-1, generated].item()]
        assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
        assert sum(lp["token_logprobs"][len(ctx):-1]) == pytest.approx(sum(expected[len(ctx) - 1 : -1]), abs=1e-4)
        if stopped:  # the end of sequence is scored and counted, not shown
            eos_seen += 1
            assert generated in smollm2_tokenizer.eos_token_ids and choice["token_ids"] == []
            assert choice["text"] == smollm2_tokenizer.decode(ids, skip_special_tokens=False)  # the prompt as sent
        # the streamed reply carries the same entries
        assert _joined(_stream(edge_server, {"prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True})) == lp
    # the case lm-evaluation-harness scored wrong is covered: where the model ends the text (its
    # greedy choice, which the kernel path's rounding decides for a near tie), the entry is there
    assert eos_seen == eos_argmax >= 1


@pytest.mark.parametrize("name", ["edge_server", "ngram_server"])
def test_eos_entry_without_echo(request, name):
    """Without echo too: one logprob entry per completion token, the end of sequence's last and
    counted; the same under speculation (ngram K=4), where the reply's tokens come several a step."""
    server = request.getfixturevalue(name)
    out = _post(server, {"prompt": CHAT_HEAD.format("Say OK.") + "OK.", "max_tokens": 5, "logprobs": 0})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == ""
    assert choice["logprobs"]["tokens"] == ["<|im_end|>"] and out["usage"]["completion_tokens"] == 1
    body = {"prompt": "One, two, three, four, five, one, two, three, four, five, one, two,", "max_tokens": 40,
            "logprobs": 1, "return_token_ids": True}
    choice, usage = (out := _post(server, body))["choices"][0], out["usage"]
    entries = len(choice["logprobs"]["tokens"])
    assert usage["completion_tokens"] == entries == len(choice["token_ids"]) + (choice["finish_reason"] == "stop")
    streamed = _stream(server, body)
    assert _joined(streamed) == choice["logprobs"]


def test_max_tokens_zero_with_echo_gives_the_prompt(edge_server, smollm2_tokenizer, teacher):
    """vLLM's max_tokens 0 with echo: the prompt's text and logprobs, no completion token."""
    prompt = "The capital of France is Paris."
    ids = _ids(smollm2_tokenizer, prompt)
    out = _post(edge_server, {"prompt": prompt, "max_tokens": 0, "logprobs": 2, "echo": True})
    choice = out["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    want = teacher(ids)
    assert lp["token_logprobs"][1:] == pytest.approx([want[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)
    chunks = _stream(edge_server, {"prompt": prompt, "max_tokens": 0, "logprobs": 2, "echo": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt and _joined(chunks) == lp
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    no_logprobs = _post(edge_server, {"prompt": prompt, "max_tokens": 0, "echo": True})["choices"][0]
    assert no_logprobs["text"] == prompt and no_logprobs["logprobs"] is None


def test_echo_keeps_special_tokens(edge_server):
    """A prompt with a special token comes back as it was sent, and the text offsets fall inside it."""
    prompt = "<|im_start|>hi"
    for body in ({"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1},
                 {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}):
        choice = _post(edge_server, body)["choices"][0]
        assert choice["text"].startswith(prompt)
        lp = choice["logprobs"]
        assert lp["tokens"][:2] == ["<|im_start|>", "hi"] and lp["text_offset"][:2] == [0, 12]
        assert all(choice["text"][o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"]))
    chunks = _stream(edge_server, {"prompt": prompt, "max_tokens": 0, "echo": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt


def test_top_logprobs_hold_the_chosen_token(edge_server):
    """OpenAI's legacy completions: each top_logprobs dict has the N most likely and the token
    chosen (N + 1 entries where it is not among them)."""
    out = _post(edge_server, {"prompt": "Question: How many legs does a spider have?\nAnswer: 18", "max_tokens": 1,
                              "logprobs": 1, "echo": True})
    lp = out["choices"][0]["logprobs"]
    sizes = []
    for token, logprob, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[token] == logprob and 1 <= len(top) <= 2 and max(top.values()) >= logprob
        sizes.append(len(top))
    assert 2 in sizes and 1 in sizes  # some chosen tokens were not the most likely, the generated one is


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's split: trailing spaces move to the continuation, the whole is
    encoded and the context's tokens cut off."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return ctx, whole[len(ctx):]


def test_lm_eval_local_completions(edge_server, smollm2_tokenizer, teacher, tmp_path, monkeypatch):
    """lm-evaluation-harness's ``local-completions`` on a small local multiple-choice task: every
    loglikelihood it records equals the teacher-forced one, and its accuracy is the accuracy
    those give."""
    lm_eval = pytest.importorskip("lm_eval", reason="pip install lm_eval (lm-evaluation-harness)")
    from lm_eval.tasks import TaskManager

    docs = [
        {"question": CHAT_HEAD.format("Say OK."), "choices": ["OK.", "No.", "Maybe later."], "answer": 0},
        {"question": CHAT_HEAD.format("Hi"), "choices": ["Hello! How can I help you today?", "Go away.", "Hi"],
         "answer": 0},
        {"question": "Question: How many legs does a spider have?\nAnswer:", "choices": [" 6", " 8", " 18", " 19"],
         "answer": 1},
        {"question": "The capital of France is", "choices": [" Paris", " Rome", " Berlin"], "answer": 0},
    ]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "qd_tiny_mc.yaml").write_text(
        "task: qd_tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'docs.jsonl'}\ntest_split: test\noutput_type: multiple_choice\ntarget_delimiter: ''\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n")
    monkeypatch.setenv("OPENAI_API_KEY", edge_server.api_key)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["qd_tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args=f"model={MODEL},base_url={edge_server.url}{C},tokenizer_backend=remote,"
                   f"auth_token={edge_server.api_key},num_concurrent=1,max_retries=1",
        log_samples=True)
    samples = results["samples"]["qd_tiny_mc"]
    assert len(samples) == len(docs)
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        scores = []
        for choice, resp in zip(doc["choices"], sample["resps"]):
            ctx, cont = _encode_pair(smollm2_tokenizer, doc["question"], choice)
            want = teacher(ctx + cont)
            expected = sum(want[len(ctx) + i - 1, t].item() for i, t in enumerate(cont))
            assert resp[0][0] == pytest.approx(expected, abs=1e-4), (doc["question"], choice)
            scores.append(expected)
        correct += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    assert results["results"]["qd_tiny_mc"]["acc,none"] == pytest.approx(correct / len(docs))
    print(f"lm-eval local-completions: {len(samples)} questions, acc {correct / len(docs):.3f}, "
          f"every loglikelihood equal to the teacher-forced one")


def _openai(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.mark.parametrize("name", ["edge_server", "ngram_server"])
def test_chat_eos_entry_is_there_and_counted(request, name):
    """Chat's logprobs as vLLM returns them, through the openai client: the end of sequence that
    ended the reply has its entry, last (its text is not in the message), and counts in
    usage.completion_tokens; streamed, the chunks' entries are the same; plain and under
    speculation (ngram K=4) alike."""
    client = _openai(request.getfixturevalue(name))
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say OK."}], max_tokens=32, temperature=0,
              logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    entries = choice.logprobs.content
    assert choice.finish_reason == "stop" and entries[-1].token == "<|im_end|>", entries[-1]
    assert len(entries) == r.usage.completion_tokens >= 2
    assert "".join(t.token for t in entries[:-1]) == choice.message.content
    for t in entries:  # greedy: the chosen token is the most likely, so the top 2 hold it first
        assert len(t.top_logprobs) == 2 and (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]) for t in streamed] == \
        [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]) for t in entries]
    assert chunks[-1].usage.completion_tokens == len(entries)
    # a reply cut by max_tokens has no end of sequence: one entry per token
    cut = client.chat.completions.create(**{**kw, "max_tokens": 1})
    assert cut.choices[0].finish_reason == "length" and len(cut.choices[0].logprobs.content) == 1 == cut.usage.completion_tokens


def test_chat_top_logprobs_hold_the_chosen_token(edge_server):
    """Chat's top_logprobs: the N most likely tokens, most likely first, and the chosen token after
    them where sampling chose one outside the N (N + 1 entries), as the completions API gives it;
    none where top_logprobs is 0."""
    client = _openai(edge_server)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
              max_tokens=48, temperature=2.0, seed=7, logprobs=True)
    entries = client.chat.completions.create(**kw, top_logprobs=1).choices[0].logprobs.content
    sizes = []
    for t in entries:
        top = [(x.token, x.logprob) for x in t.top_logprobs]
        assert (t.token, t.logprob) in top and top[0][1] >= t.logprob
        assert len(top) == (1 if top[0] == (t.token, t.logprob) else 2), (t.token, top)
        sizes.append(len(top))
    assert 2 in sizes, sizes  # at temperature 2, some sampled tokens were not the most likely
    none = client.chat.completions.create(**kw, top_logprobs=0).choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in none] == [(t.token, t.logprob) for t in entries]
    assert all(t.top_logprobs == [] for t in none)
