"""Where a one-row pass of a model goes as its context grows: the attention's time beside the
bytes of keys and values it reads (the cache's dtype) over the measured bandwidth, and the pass
against its floor with those bytes counted (quickdraft.measure.pass_split at each context).

    python long_context_split.py qwen2.5-coder-1.5b-instruct 256,2048,4000
"""
import sys

from quickdraft.kv_cache import KVCache
from quickdraft.llm import LLM
from quickdraft.measure import measure_bandwidth, pass_split

model, contexts = sys.argv[1], [int(c) for c in sys.argv[2].split(",")]
llm = LLM(model, max_model_len=max(contexts) + 64)
decoder, kv = llm.engine.decoder, llm.engine.kv
bandwidth = measure_bandwidth()["bandwidth_bytes_per_s"]
per_token = KVCache.bytes_per_token(decoder.config, kv.keys[0].dtype)
print(f"{model}: bandwidth {bandwidth / 1e9:.1f} GB/s, keys and values {per_token} bytes a token ({kv.keys[0].dtype})")
for context in contexts:
    s = pass_split(decoder, kv, bandwidth, context=context)
    kv_floor = per_token * (context + 1) / bandwidth * 1e3
    print(f"context {context}: pass {s['total_ms']:.2f} ms (weights' floor {s['floor_ms']:.2f}, with the cache's bytes "
          f"{s['floor_ms'] + kv_floor:.2f}: {(s['floor_ms'] + kv_floor) / s['total_ms']:.0%}); attention {s['attention_ms']:.2f} ms "
          f"against its bytes' floor {kv_floor:.2f}; matrices {s['matrices_ms']:.2f}, head {s['head_ms']:.2f}", flush=True)
