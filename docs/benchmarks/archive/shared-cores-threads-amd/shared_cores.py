"""Plain decoding, tokens/s, with the cores free and beside one CPU-bound process started just
before the request (so the load average has not seen it), in rounds.

    python shared_cores.py MODEL on|off

``off`` runs without the engine's thread governor (the count stays as it started).
"""

import subprocess
import sys
import time

from quickdraft.llm import LLM
from quickdraft.sampling import SamplingParams

llm = LLM(sys.argv[1], max_model_len=1024)
if sys.argv[2] == "off":
    llm.engine.threads = None
params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
messages = [{"role": "user", "content": "Write a Python function that parses a CSV file and returns the rows as dicts."}]


def tokens_per_second() -> float:
    started = time.perf_counter()
    out = llm.chat(messages, params)[0]
    return len(out.token_ids) / (time.perf_counter() - started)


tokens_per_second()  # warm-up
for round_ in range(2):
    free = tokens_per_second()
    busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    time.sleep(0.3)
    shared = tokens_per_second()
    busy.kill()
    busy.wait()
    changes = llm.engine.threads.changes if llm.engine.threads is not None else None
    print(f"round {round_}: cores free {free:.2f} tok/s, beside a busy process {shared:.2f} tok/s -> a step takes "
          f"{free / shared:.2f}x; thread count changes so far: {changes}", flush=True)
