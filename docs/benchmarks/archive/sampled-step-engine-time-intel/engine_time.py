"""The engine's own time a decoding step (quickdraft.measure.engine_split) of the 1.5B with the 0.5B
draft (K up to 4, adaptive, its 65,536-row truncated head), one request of the profile's prompt, at a
temperature (0: greedy) with seed 0: three splits of 32 steps in one process, each split's medians
in ms. The request's parameters are set by wrapping SamplingParams, so that the script runs on code
from before engine_split took a temperature.

    python engine_time.py LABEL TEMPERATURE
"""
import dataclasses
import sys

import quickdraft.sampling as sampling
from quickdraft.commands.profile import SPLIT_PROMPT
from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.engine.engine import Engine
from quickdraft.measure import engine_split

label, temperature = sys.argv[1], float(sys.argv[2])
spec = SpeculativeConfig.parse('{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}')
engine = Engine(EngineConfig(model="qwen2.5-coder-1.5b-instruct", max_model_len=512, max_num_seqs=1,
                             speculative=dataclasses.replace(spec, adaptive=True)))
prompt = engine.tokenizer.encode(SPLIT_PROMPT)
plain = sampling.SamplingParams


class Params(plain):  # engine_split's request, at this temperature
    def __init__(self, **kwargs):
        super().__init__(**{**kwargs, "temperature": temperature, "seed": 0})


sampling.SamplingParams = Params
splits = [engine_split(engine, prompt) for _ in range(3)]
print(f"{label} t={temperature:g}: engine {[round(s['engine_ms'], 2) for s in splits]} ms, "
      f"verify phase {[round(s['phases_ms']['verify'], 2) for s in splits]}, "
      f"propose phase {[round(s['phases_ms']['propose'], 1) for s in splits]}, step {[round(s['step_ms'], 1) for s in splits]}")
