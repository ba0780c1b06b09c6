"""Grammar drafts (quickdraft/structured.py) on a JSON-schema request, SmolLM2-135M-Instruct
(bfloat16, its GGUF blocks as stored), greedy: tokens per target pass and tok/s of plain
constrained decoding (no drafts), of the grammar's forced tokens as drafts, and of n-gram drafts
with them; medians of 3 rounds after a warm-up, the modes interleaved. Prints README rows.

    python examples/grammar_drafts.py
"""
import json, statistics, time
import jsonschema
from quickdraft import LLM, SamplingParams
from quickdraft.structured import StructuredSpec
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "maxLength": 40}, "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 30}, "city": {"type": "string", "maxLength": 20},
                "country": {"type": "string", "maxLength": 20}}, "required": ["street", "city", "country"], "additionalProperties": False},
    "employed": {"type": "boolean"}},
  "required": ["name", "age", "email", "skills", "address", "employed"], "additionalProperties": False}
PROMPTS = [f"<|im_start|>user\nDescribe {who} as a JSON record.<|im_end|>\n<|im_start|>assistant\n"
           for who in ["a software engineer from Berlin", "a retired teacher", "a young painter from Lisbon"]]
spec = StructuredSpec.json_schema(SCHEMA)
MODES = {
    "plain constrained (no drafts)": (None, 0),
    "none + grammar drafts": (None, None),
    "ngram K=4 + grammar drafts": ({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}, None),
}
llms = {m: LLM("smollm2-135m-instruct", speculative_config=c) for m, (c, _) in MODES.items()}
res = {m: [] for m in MODES}
texts = {}
for rep in range(4):
    for m, (c, cap) in MODES.items():
        llm = llms[m]
        params = SamplingParams(max_tokens=300, temperature=0, structured=spec, num_speculative_tokens=cap)
        t = time.perf_counter(); outs = [llm.generate([p], params)[0] for p in PROMPTS]; dt = time.perf_counter() - t
        toks = sum(len(o.token_ids) for o in outs); passes = sum(o.spec.num_target_passes for o in outs)
        for o in outs: assert o.finish_reason == "stop", o.text; jsonschema.validate(json.loads(o.text), SCHEMA)
        if rep: res[m].append((toks / passes, toks / dt))  # the first round warms up
        texts.setdefault(m, [o.token_ids for o in outs])
same = len({json.dumps(v) for v in texts.values()}) == 1
base = statistics.median(r[1] for r in res["plain constrained (no drafts)"])
for m, r in res.items():
    tpp, tps = statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)
    print(f"| {m} | {tpp:.2f} | {tps:.1f} | {tps / base:.2f}x |")
print("greedy outputs identical across modes:", same, "; tokens:", [len(t) for t in texts["plain constrained (no drafts)"]])
