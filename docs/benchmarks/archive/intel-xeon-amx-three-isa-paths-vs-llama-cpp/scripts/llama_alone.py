"""llama.cpp plain decoding alone: tok/s of 128 greedy tokens on one code prompt, after a warm-up."""
import json, os, sys, time
from llama_cpp import Llama
llm = Llama(model_path=os.path.expanduser("~/.cache/quickdraft/models/qwen2.5-coder-1.5b-instruct.gguf"), n_ctx=2048,
            n_threads=2, n_threads_batch=2, verbose=False)
prompt = json.loads(open("/work/main/examples/code_prompts.jsonl").readline())
text = "<|im_start|>user\n" + prompt["messages"][0]["content"] + "<|im_end|>\n<|im_start|>assistant\n"
ids = llm.tokenize(text.encode())
def run(n):
    llm.reset(); out = []; t0 = None
    for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        if t0 is None: t0 = time.perf_counter()
        out.append(tok)
        if len(out) >= n: break
    return (len(out) - 1) / (time.perf_counter() - t0)
run(8)
print(os.environ.get("OMP_WAIT_POLICY", "default"), [round(run(128), 2) for _ in range(2)], flush=True)
