"""Decoding on one NVIDIA GPU: quickdraft eager, quickdraft with CUDA graphs, and Hugging Face
transformers' generate, on random models of Qwen2.5-Coder-1.5B's and 0.5B's shapes in bfloat16
(random weights: the shapes and the work are the real models', the text is not).

    python decode_step.py --out results.json [--tokens 128] [--hf-static]

Measures, each median of --repeats runs after one warm-up:
- plain greedy decoding, batch 1, --tokens new tokens after a 32-token prompt: tokens/s;
- the target's pass by rows (1, 2, 4, 8, 16 new tokens of one sequence at 256 tokens of context,
  the verification pass's shape): milliseconds, eager and graphed;
- speculative decoding with K=4: the 0.5B-shaped draft (random: it is never right, so this is the
  cost of speculating for nothing) and the target as its own draft (always right: the most a
  draft's passes can buy);
- Hugging Face: generate() with its dynamic cache (eager), and with --hf-static its static cache,
  which it compiles with torch.compile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from quickdraft.kv_cache import KVCache
from quickdraft.llm import LLM
from quickdraft.models.config import ModelConfig
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.models.loader import LoadedModel
from quickdraft.sampling import SamplingParams

SHAPES = {  # Qwen2.5-Coder-1.5B-Instruct and 0.5B-Instruct (their config.json)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2),
}


def config(name: str, layers: int | None = None) -> ModelConfig:
    s = dict(SHAPES[name], **({"num_layers": layers} if layers else {}))
    return ModelConfig(arch="qwen2", vocab_size=151936, head_dim=s["hidden_size"] // s["num_heads"], rope_theta=1e6,
                       rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True,
                       eos_token_ids=(), name=f"random-{name}", **s)


def hf_model(c: ModelConfig, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hc = Qwen2Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                     num_key_value_heads=c.num_kv_heads, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
                     max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(hc).to(torch.bfloat16).eval()
    return model


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds(fn, repeats: int) -> float:
    fn()  # warm-up (and the graphs' captures)
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-static", action="store_true")
    ap.add_argument("--out", default="results.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a dry run of this script)")
    args = ap.parse_args()
    n = args.tokens
    dev = args.device
    out = {"gpu": torch.cuda.get_device_name() if dev.startswith("cuda") else dev, "torch": torch.__version__,
           "tokens": n, "runs": {}}
    runs = out["runs"]

    def record(name, value):
        runs[name] = value
        print(f"{name}: {value}", flush=True)

    prompt = torch.randint(0, 151936, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    configs = {name: config(name, args.layers) for name in SHAPES}
    hf = {name: hf_model(c, dev) for name, c in configs.items()}
    weights = {name: {k: v for k, v in m.state_dict().items() if k in configs[name].weight_names()}
               for name, m in hf.items()}
    target = LoadedModel(configs["1.5b"], weights["1.5b"], None, "random-1.5b")
    draft = LoadedModel(configs["0.5b"], weights["0.5b"], None, "random-0.5b")
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)]

    # plain and speculative decoding, eager and graphed, interleaved
    specs = {"plain": None,
             "draft 0.5b (never right), K=4": {"method": "draft_model", "model": draft, "num_speculative_tokens": 4,
                                                "adaptive": False},
             "self-draft (always right), K=4": {"method": "draft_model", "model": target, "num_speculative_tokens": 4,
                                                "adaptive": False}}
    texts = {}
    for label, spec in specs.items():
        for eager in (True, False):
            llm = LLM(target, speculative_config=spec, dtype="bfloat16", device=dev, max_model_len=1024,
                      max_num_seqs=1, enforce_eager=eager)
            got = []
            s = seconds(lambda: got.append(llm.engine.generate_ids([prompt], params)[0].token_ids), args.repeats)
            texts[(label, eager)] = got[-1]
            record(f"quickdraft {label}, {'eager' if eager else 'CUDA graphs'}: tok/s", round(n / s, 1))
            del llm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    # speculative against plain decoding the same way (eager or graphs); graphs against eager
    out["same_tokens_as_plain"] = {f"{k[0]}, {'eager' if k[1] else 'graphs'}": v == texts[("plain", k[1])]
                                   for k, v in texts.items()}
    out["graphs_same_tokens_as_eager"] = texts[("plain", False)] == texts[("plain", True)]
    print(out["same_tokens_as_plain"], out["graphs_same_tokens_as_eager"], flush=True)
    plain = texts[("plain", True)]

    # a pass by rows, one sequence at 256 tokens of context: the target's (a verification's shape)
    # and the draft's one-row pass
    for (name, m, rows), eager in itertools.product((("target", target, (1, 2, 4, 8, 16)), ("draft", draft, (1,))),
                                                    (True, False)):
        model = Decoder(m.config, m.weights, cuda_graphs=not eager)
        kv = KVCache(m.config, 1, 512, torch.bfloat16, dev)
        for q in rows:
            meta = AttentionMetadata.chain([0], [256], [q])
            tokens = torch.tensor(prompt[:q], dtype=torch.long, device=dev)
            positions = meta.positions(dev)

            def one_pass():
                model.logits(model.forward(tokens, positions, kv, meta))

            times = []
            one_pass()
            for _ in range(20):
                sync()
                t = time.perf_counter()
                one_pass()
                sync()
                times.append(time.perf_counter() - t)
            record(f"{name} pass, {q} rows, {'eager' if eager else 'CUDA graphs'}: ms",
                   round(1000 * statistics.median(times), 3))

    # Hugging Face generate, greedy, no end of sequence
    ids = torch.tensor([prompt], device=dev)
    m = hf["1.5b"]
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        gen = []
        s = seconds(lambda: gen.append(m.generate(ids, **kwargs)), args.repeats)
        record("transformers generate, dynamic cache (eager): tok/s", round(n / s, 1))
        # random weights (std 0.02) leave near-ties everywhere, so bfloat16 rounding may part the texts
        out["transformers_same_tokens_as_quickdraft"] = gen[-1][0, 32:].tolist() == plain
        if args.hf_static:
            t = time.perf_counter()
            s = seconds(lambda: m.generate(ids, cache_implementation="static", **kwargs), args.repeats)
            record("transformers generate, static cache (torch.compile): tok/s", round(n / s, 1))
            record("transformers static cache: first call + runs, s", round(time.perf_counter() - t, 1))
    print(json.dumps(out, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
