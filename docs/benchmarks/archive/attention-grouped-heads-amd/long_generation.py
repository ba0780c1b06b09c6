"""Tokens/s over a long greedy generation of plain decoding: the first 512 tokens against the last 512.

    python long_generation.py qwen2.5-coder-1.5b-instruct 4096
"""
import sys
import time

from quickdraft.llm import LLM
from quickdraft.sampling import SamplingParams

model, n = sys.argv[1], int(sys.argv[2])
llm = LLM(model, max_model_len=n + 256)
engine = llm.engine
ids = llm.tokenizer.encode("Write a long story about a lighthouse keeper and the sea.")
engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
marks, done = [], 0  # (tokens so far, time)
while engine.has_unfinished():
    for out in engine.step():
        done = len(out.token_ids)
    marks.append((done, time.perf_counter()))


def rate(a: int, b: int) -> float:
    ta = next(t for k, t in marks if k >= a)
    tb = next(t for k, t in marks if k >= b)
    return (b - a) / (tb - ta)


first, last = rate(1, 513), rate(n - 512, n)
print(f"{model} n={n}: first 512 {first:.2f} tok/s, last 512 {last:.2f} tok/s, ratio {last / first:.3f}")
