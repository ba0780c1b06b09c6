"""Plain decoding (no speculation), sampled at temperature 0.7: the verification phase's median time a
step (where the target's row becomes p and is drawn from) and the step's.

    python verify_phase.py LABEL
"""
import statistics
import sys
import time

from quickdraft import LLM
from quickdraft.sampling import SamplingParams

llm = LLM("qwen2.5-coder-1.5b-instruct")
engine = llm.engine
verify, steps = [], []
for seed, prompt in enumerate(["Write a Python function that merges two sorted lists.", "Explain what a Python generator is."]):
    engine.add_request(list(llm.tokenizer.encode(prompt)),
                       SamplingParams(max_tokens=64, temperature=0.7, seed=seed, ignore_eos=True))
    first = True  # the prompt's step is left out
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        if not first:
            verify.append(engine.runner.times.seconds["verify"])
            steps.append(seconds)
        first = False
print(f"{sys.argv[1]}: verify phase median {1e3 * statistics.median(verify):.3f} ms, "
      f"step median {1e3 * statistics.median(steps):.2f} ms ({len(steps)} steps)")
