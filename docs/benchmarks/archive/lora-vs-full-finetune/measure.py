"""Full fine-tune against LoRA for ``quickdraft train draft``, at equal steps, on one core.

The target is SmolLM2-135M-Instruct; the draft is its own first ``--layers`` layers (with its final
norm and tied head), a model that drafts badly until it is distilled towards the whole one. Each
``train`` run is its own process, so its peak RSS is its own; ``accept`` then drafts for the target
with the stock truncated draft and each trained one on prompts of its own (no bench set).

    OMP_NUM_THREADS=1 python docs/benchmarks/archive/lora-vs-full-finetune/measure.py train full --lr 2e-5
    OMP_NUM_THREADS=1 python docs/benchmarks/archive/lora-vs-full-finetune/measure.py train lora --rank 16 --lr 2e-4
    OMP_NUM_THREADS=1 python docs/benchmarks/archive/lora-vs-full-finetune/measure.py accept /tmp/lora/full /tmp/lora/lora16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import time

import torch

from quickdraft import LLM, SamplingParams
from quickdraft.models.loader import LoadedModel, load_model
from quickdraft.train import data, draft as distill
from quickdraft.train.loop import batches, head_rows

PROMPTS = ["def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
           "import json\n\n\ndef load_config(path):\n",
           "The main difference between a process and a thread is",
           "Here is a short recipe for pancakes:\n1."]


def truncated(target, layers: int) -> LoadedModel:
    cfg = dataclasses.replace(target.config, num_layers=layers)
    weights = {n: target.weights[n] for n in cfg.weight_names()}
    return LoadedModel(cfg, weights, target.tokenizer, f"{target.source}[:{layers} layers]")


def held_out_kl(module, target_head, windows) -> tuple[float, float]:
    """Mean KL and argmax agreement over ``windows``, two at a time, in float32."""
    kls, agrees = [], []
    with torch.no_grad():
        for _, batch in zip(range(0, len(windows), 2), batches(windows, 2, seed=0)):
            kl, m = distill.kl_loss(module, target_head, batch)
            kls.append(float(kl))
            agrees.append(m["agree"])
    return sum(kls) / len(kls), sum(agrees) / len(agrees)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(args) -> None:
    target = load_model("smollm2-135m-instruct", torch.float32, quantization="none")
    windows = data.load_windows(args.data, target)
    held, train_windows = windows[: args.held_out], windows[args.held_out :]
    draft = truncated(target, args.layers)
    target_head = head_rows(target, torch.arange(target.config.vocab_size))
    before = held_out_kl(distill.TrainableDraft(draft).eval(), target_head, held)
    base_rss = rss_mib()
    started = time.perf_counter()
    module, losses = distill.train(target, draft, train_windows, args.out, args.steps, args.batch_size, args.lr,
                                   progress=False, lora_rank=args.rank if args.mode == "lora" else 0)
    seconds = time.perf_counter() - started
    after = held_out_kl(module, target_head, held)
    print(json.dumps({"mode": args.mode, "rank": args.rank if args.mode == "lora" else None, "lr": args.lr,
                      "steps": args.steps, "batch": f"{args.batch_size} x {train_windows[0].tokens.shape[0]}",
                      "trainable": sum(p.numel() for p in module.parameters()) if args.mode == "full" else None,
                      "seconds_a_step": round(seconds / args.steps, 2), "peak_rss_mib": round(rss_mib()),
                      "rss_before_training_mib": round(base_rss),
                      "loss_first5": round(sum(losses[:5]) / 5, 3), "loss_last5": round(sum(losses[-5:]) / 5, 3),
                      "held_out_kl": [round(before[0], 3), round(after[0], 3)],
                      "held_out_agree": [round(before[1], 3), round(after[1], 3)]}))


def accept(args) -> None:
    target = load_model("smollm2-135m-instruct", torch.float32, quantization="none")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(target, dtype="float32").generate(PROMPTS, params)]
    for name in ["stock", *args.dirs]:
        d = truncated(target, args.layers) if name == "stock" else name
        llm = LLM(target, dtype="float32", speculative_config={"method": "draft_model", "model": d,
                                                              "num_speculative_tokens": 3, "adaptive": False})
        same = [o.token_ids for o in llm.generate(PROMPTS, params)] == plain
        s = llm.engine.stats
        print(json.dumps({"draft": name, "acceptance": round(s.num_accepted_tokens / s.num_draft_tokens, 3),
                          "tokens_a_pass": round((s.num_accepted_tokens + s.num_target_passes) / s.num_target_passes, 2),
                          "same_as_plain": same}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/tmp/lora/data")
    ap.add_argument("--layers", type=int, default=10)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("mode", choices=["full", "lora"])
    t.add_argument("--rank", type=int, default=16)
    t.add_argument("--lr", type=float, required=True)
    t.add_argument("--steps", type=int, default=60)
    t.add_argument("--batch-size", type=int, default=2)
    t.add_argument("--held-out", type=int, default=8)
    t.add_argument("--out", required=True)
    t.set_defaults(func=train)
    a = sub.add_parser("accept")
    a.add_argument("dirs", nargs="+")
    a.add_argument("--max-tokens", type=int, default=48)
    a.set_defaults(func=accept)
    args = ap.parse_args()
    args.func(args)
