"""Plain decoding (no speculation), sampled at temperature 0.7: the verification phase's median time a
step (where the target's row becomes p and is drawn from) and the step's.

    python verify_phase.py LABEL
"""
import sys, time, statistics as st
from quickdraft import LLM
from quickdraft.sampling import SamplingParams
llm = LLM("qwen2.5-coder-1.5b-instruct")
eng = llm.engine
ver, steps = [], []
for j, p in enumerate(["Write a Python function that merges two sorted lists.", "Explain what a Python generator is."]):
    ids = llm.tokenizer.encode(p)
    eng.add_request(list(ids), SamplingParams(max_tokens=64, temperature=0.7, seed=j, ignore_eos=True))
    first = True
    while eng.has_unfinished():
        t = time.perf_counter(); eng.step(); dt = time.perf_counter() - t
        if not first:
            ver.append(eng.runner.times.seconds["verify"]); steps.append(dt)
        first = False
print(f"{sys.argv[1]}: verify phase median {1e3*st.median(ver):.3f} ms, step median {1e3*st.median(steps):.2f} ms ({len(steps)} steps)")
