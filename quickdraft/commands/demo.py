"""`make demo` (``python -m quickdraft.demo``): one HumanEval prompt through Qwen2.5-Coder-1.5B, plain and then with the 0.5B
draft; both texts (identical), tokens/s of each, the speedup and the acceptance figures."""

from __future__ import annotations

import sys

import torch

from quickdraft import LLM, SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.evaluation.datasets import humaneval
from quickdraft.evaluation.measure import summarize
from quickdraft.models.loader import load_model

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def demo() -> int:
    prompt = humaneval(limit=1)[0].prompt
    params = SamplingParams(max_tokens=128, temperature=0)
    target = load_model(TARGET, torch.bfloat16)
    runs = {}
    for name, spec in (("plain", None), ("draft_model", {"method": "draft_model", "model": DRAFT,
                                                           "num_speculative_tokens": 8})):
        llm = LLM(target, speculative_config=spec, dtype="bfloat16", max_num_seqs=1)
        llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))  # warm up
        out = llm.generate([prompt], params)[0]
        runs[name] = summarize(out, llm.engine.config.speculative)
        print(f"===== {name} ({runs[name]['tokens_per_second']:.2f} tok/s) =====\n{prompt}{out.text}\n")
    plain, spec = runs["plain"], runs["draft_model"]
    s = spec["spec"]
    print(f"identical tokens: {plain['token_ids'] == spec['token_ids']}")
    # tokens/s after the first token; the first comes after the prompt's pass (the draft's too)
    print(f"plain        {plain['tokens_per_second']:.2f} tok/s  first token after {plain['ttft_s']:.2f} s")
    print(f"draft_model  {spec['tokens_per_second']:.2f} tok/s  first token after {spec['ttft_s']:.2f} s  "
          f"speedup {spec['tokens_per_second'] / plain['tokens_per_second']:.2f}x")
    print(f"acceptance {s['acceptance_rate']:.1%}, {s['mean_accepted_length']:.2f} tokens per target pass, "
          f"per position {[round(a, 2) for a in s['accepted_per_position']]}")
    return 0


def main() -> int:
    try:
        return demo()
    except QuickdraftError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
