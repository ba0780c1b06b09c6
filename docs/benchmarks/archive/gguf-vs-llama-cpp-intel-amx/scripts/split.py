"""Where a one-row decoding step of the 1.5B goes (stored blocks, plain decoding through the engine):
64 tokens of `none` greedy after a warm-up, under cProfile: the 28 fused layer calls, the output
head's call, and the rest of the engine, a token each; beside them the layers' matrices alone
(every layer's matrix calls at one row in the pass's order, so they stream from memory as in
decoding; the median of 3 interleaved rounds of 10).
    python docs/benchmarks/archive/gguf-vs-llama-cpp-intel-amx/scripts/split.py
"""
import cProfile, pstats, statistics, time, torch
from quickdraft import LLM, SamplingParams
from quickdraft.models.decoder import linear

llm = LLM("qwen2.5-coder-1.5b-instruct")
params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
prompt = 'def is_prime(n):\n    """Return True if n is prime."""\n'
llm.generate([prompt], params)
prof = cProfile.Profile()
prof.enable()
out = llm.generate([prompt], params)[0]
prof.disable()
n = len(out.token_ids) - 1  # the first token comes from the prompt's pass
decode_ms = (out.finish_time - out.first_token_time) * 1e3 / n
calls = {f[2]: v for f, v in pstats.Stats(prof).stats.items()}
layers_ms = calls["<built-in method quickdraft_linear.decoder_layer>"][3] * 1e3 / (n + 1)
head_ms = calls["<built-in method quickdraft_linear.linear_blocks>"][3] * 1e3 / (n + 1)

d = llm.engine.runner.target
mats = [w for name, w in d.w.items() if name.endswith("proj.weight")]
xs = {w.in_features: torch.randn(1, w.in_features, dtype=torch.bfloat16) for w in mats}
def matrices():
    for w in mats:
        linear(xs[w.in_features], w)
rounds = []
with torch.inference_mode():
    for _ in range(3):
        ts = []
        for _ in range(10):
            t0 = time.perf_counter(); matrices(); ts.append(time.perf_counter() - t0)
        rounds.append(statistics.median(ts))
mat_ms = statistics.median(rounds) * 1e3
mib = sum(w.nbytes for w in mats) / 2**20
head_mib = d.lm_head.nbytes / 2**20
print(f"a token: {decode_ms:.1f} ms ({1e3 / decode_ms:.1f} tok/s); the 28 layer calls {layers_ms:.1f} ms, of which the "
      f"matrices alone {mat_ms:.1f} ms ({mib:.0f} MiB, {mib / 1024 / mat_ms * 1e3:.1f} GiB/s); the head {head_ms:.1f} ms "
      f"({head_mib:.0f} MiB, {head_mib / 1024 / head_ms * 1e3:.1f} GiB/s); the rest of the engine "
      f"{decode_ms - layers_ms - head_ms:.1f} ms")
