"""llama.cpp plain decoding alone: tok/s of 128 greedy tokens on the first code prompt, twice, after a
warm-up; run from the repository's root, by turns with and without the bench's OpenMP settings:

    python llama_alone.py
    GOMP_SPINCOUNT=300000 OMP_WAIT_POLICY=active python llama_alone.py
"""
import json
import os
import time

from llama_cpp import Llama

from quickdraft.models.registry import model_path

llm = Llama(model_path=str(model_path("qwen2.5-coder-1.5b-instruct")), n_ctx=2048, n_threads=2, n_threads_batch=2,
            verbose=False)
prompt = json.loads(open("examples/code_prompts.jsonl").readline())
text = "<|im_start|>user\n" + prompt["messages"][0]["content"] + "<|im_end|>\n<|im_start|>assistant\n"
ids = llm.tokenize(text.encode())


def tokens_per_second(n: int) -> float:
    """n greedy tokens, timed from the first one (the prompt's pass left out)."""
    llm.reset()
    out, start = [], None
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        if start is None:
            start = time.perf_counter()
        out.append(token)
        if len(out) >= n:
            break
    return (len(out) - 1) / (time.perf_counter() - start)


tokens_per_second(8)  # warm-up
print(os.environ.get("OMP_WAIT_POLICY", "default"), [round(tokens_per_second(128), 2) for _ in range(2)], flush=True)
