"""The proposer's time a step by the draft tokens it made, for sampled requests (temperature 0.7):
the 1.5B target with the 0.5B draft, two code prompts, 96 tokens, three rounds; medians in ms.

    python propose_by_k.py LABEL native,python

LABEL names the run in the output; the second argument the modes to take by turns: ``native``
(the draft's chains in one native call) and ``python`` (the draft's pass-by-pass loop)."""
import sys, time, statistics as st
from collections import defaultdict
import quickdraft.engine.runner as R
from quickdraft import LLM
from quickdraft.sampling import SamplingParams
rec = []
orig = R.Runner._learn
def learn(self, batch, results, times):
    rec.append((tuple(batch.proposal.num_tokens), dict(times.seconds)))
    return orig(self, batch, results, times)
R.Runner._learn = learn
spec = {"method":"draft_model","model":"qwen2.5-coder-0.5b-instruct","num_speculative_tokens":4}
llm = LLM("qwen2.5-coder-1.5b-instruct", speculative_config=spec)
prop = llm.engine.proposer
modes = sys.argv[2].split(",")
prompts = ["Write a Python function that merges two sorted lists into one sorted list.",
           "Implement binary search over a sorted Python list, returning -1 when absent."]
res = defaultdict(lambda: defaultdict(list))
for rep in range(3):
    for mode in modes:
        prop.native_chains = mode == "native"
        for j, p in enumerate(prompts):
            rec.clear()
            llm.chat([{"role":"user","content":p}], SamplingParams(max_tokens=96, temperature=0.7, seed=rep*7+j))
            for ks, s in rec[1:]:
                res[mode][ks[0]].append(s["propose"])
for mode in modes:
    print(sys.argv[1], mode, {k: (len(v), round(1e3*st.median(v),1)) for k, v in sorted(res[mode].items()) if k})
