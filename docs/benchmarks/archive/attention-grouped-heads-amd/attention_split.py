"""One-row decoding pass of a model at several context lengths, split into matrices, attention,
the rest of the layers, the rest of the pass and the head (quickdraft.measure.pass_split).

    python attention_split.py qwen2.5-coder-1.5b-instruct 256,4000 2   # model, contexts, rounds
"""
import sys

from quickdraft.llm import LLM
from quickdraft.measure import pass_split

name, contexts = sys.argv[1], [int(c) for c in sys.argv[2].split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
engine = LLM(name, max_model_len=max(contexts) + 200).engine
keys = ("matrices_ms", "attention_ms", "other_layer_ms", "outside_layers_ms", "head_ms")
for _ in range(rounds):
    for context in contexts:  # the bandwidth only sets the floors, which are not printed here
        split = pass_split(engine.decoder, engine.kv, 40e9, context=context, passes=20)
        print(context, {k: round(split[k], 2) for k in keys}, flush=True)
