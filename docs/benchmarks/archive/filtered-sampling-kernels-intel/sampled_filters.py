"""Sampled decoding under top-p, top-k and a temperature alone: tokens/s and the median propose
and verify phases a step, for plain decoding and for the 0.5B draft (K = 4), on the 1.5B target,
three held-out code prompts (examples/code_prompts.jsonl), 128 tokens each.

    python sampled_filters.py LABEL

LABEL names the run in the output (the code on PYTHONPATH decides what runs)."""
import json
import statistics
import sys
import time
from pathlib import Path

from quickdraft import LLM
from quickdraft.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[4]
PROMPTS = [json.loads(line)["messages"] for line in (ROOT / "examples" / "code_prompts.jsonl").open()][:3]
SAMPLING = {"temperature 0.7": {}, "top_p 0.9": {"top_p": 0.9}, "top_k 50": {"top_k": 50}}
SPECS = {"none": None, "draft_model": {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct",
                                       "num_speculative_tokens": 4}}

for method, spec in SPECS.items():
    llm = LLM("qwen2.5-coder-1.5b-instruct", speculative_config=spec)
    engine = llm.engine
    for name, extra in SAMPLING.items():
        rates, propose, verify = [], [], []
        for seed, messages in enumerate(PROMPTS):
            ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages))
            engine.add_request(list(ids), SamplingParams(max_tokens=128, temperature=0.7, seed=seed, ignore_eos=True,
                                                         **extra))
            engine.step()  # the prompt's pass
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
                propose.append(engine.runner.times.seconds.get("propose", 0.0))
                verify.append(engine.runner.times.seconds["verify"])
            rates.append(127 / (time.perf_counter() - start))
        print(f"{sys.argv[1]} {method:11s} {name:15s} {statistics.median(rates):6.2f} tok/s  "
              f"propose {1e3 * statistics.median(propose):6.2f} ms  verify {1e3 * statistics.median(verify):6.2f} ms",
              flush=True)
    llm.close()
