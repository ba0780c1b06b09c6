"""``quickdraft train data | eagle3 | medusa | draft``: training data from the target, then heads
(or a distilled draft model).

Everything lands in the cache, never in the repository: the data in
``$QUICKDRAFT_CACHE/heads/<target>/data/``, the heads in ``.../<target>/eagle3/`` and
``.../<target>/medusa/``, where ``--speculative-config '{"method": "eagle3"}'`` finds them. Each
step resumes after an interruption (data shards, training checkpoints); rerun the same command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from quickdraft.arguments import add_dtype_arg, add_flag, add_model_positional


def register(sub) -> None:
    t = sub.add_parser("train", help="train EAGLE-3 or Medusa heads on the target's own states")
    tsub = t.add_subparsers(dest="train_command", required=True)
    d = tsub.add_parser("data", help="label texts with the target: hidden states for the heads, sharded, resumable")
    _data_args(d)
    d.set_defaults(func=_data)
    for method in ("eagle3", "medusa"):
        p = tsub.add_parser(method, help=f"train the target's {method} head (makes or resumes its data first)")
        _data_args(p)
        add_flag(p, "--output-dir", default=None, deprecated=("--out",),
                 help=f"the head's directory (default: the cache's, $QUICKDRAFT_CACHE/heads/<target>/{method})")
        p.add_argument("--steps", type=int, default=2000, help="optimiser steps")
        p.add_argument("--batch-size", type=int, default=4, help="windows a step")
        p.add_argument("--lr", type=float, default=1e-3)
        p.add_argument("--draft-vocab-size", type=int, default=32768,
                       help="rows of the head's output: the most frequent target tokens of the data")
        p.add_argument("--seed", type=int, default=0)
        _precision_arg(p)
        if method == "eagle3":
            p.add_argument("--ttt-steps", type=int, default=3, help="unrolled drafting steps of the training-time test")
        else:
            p.add_argument("--num-heads", type=int, default=4, help="K: heads, one a draft position")
        p.set_defaults(func=_train, method=method)
    g = tsub.add_parser("generate", help="self-distillation texts: the target's own answers to prompts, for --texts")
    add_model_positional(g)
    g.add_argument("--model", default="smollm2-135m-instruct", help="the target: a built-in name, .gguf or HF directory")
    g.add_argument("--prompts", default=None, help="JSONL (\"prompt\": raw text, or \"messages\": a chat); default: "
                                                   "functions and package summaries of the installed packages")
    g.add_argument("--num-prompts", type=int, default=400, help="prompts to answer (the first N)")
    add_flag(g, "--output-file", default=None, deprecated=("--out",),
             help="the JSONL of texts (default: $QUICKDRAFT_CACHE/heads/<target>/generated/answers.jsonl)")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens an answer, at most")
    add_flag(g, "--batch-size", type=int, default=8, deprecated=("--batch",), help="prompts decoded together")
    g.add_argument("--speculative-config", default=None, help="JSON: speculate while generating (the output is the same)")
    g.set_defaults(func=_generate)
    p = tsub.add_parser("draft", help="distill the draft model towards the target (KL on the target's data)")
    _data_args(p)
    add_flag(p, "--draft-model", default="qwen2.5-coder-0.5b-instruct", deprecated=("--draft",),
             help="the draft model to fine-tune")
    add_flag(p, "--output-dir", default=None, deprecated=("--out",),
             help="the tuned draft's directory (default: $QUICKDRAFT_CACHE/heads/<target>/draft)")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 for LoRA, 2e-5 for a full fine-tune")
    p.add_argument("--seed", type=int, default=0)
    # LoRA by default: at equal steps it reached a lower KL than the full fine-tune with half the
    # training memory (docs/benchmarks/archive/lora-vs-full-finetune/README.md)
    p.add_argument("--lora-rank", type=int, default=16, help="train LoRA adapters of this rank (through peft) and "
                                                             "merge them into the saved weights; 0: a full fine-tune")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA's alpha (default 2 x rank)")
    p.add_argument("--draft-layers", default=None,
                   help="drop layers first, for a cheaper draft: N keeps N evenly spaced (the first and last among "
                        "them), or the indices to keep, comma-separated (default: all)")
    p.add_argument("--lora-targets", default=None, help="the matrices LoRA adapts, comma-separated (default "
                                                         "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    _precision_arg(p)
    p.set_defaults(func=_draft)


def _precision_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "float32"],
                   help="bf16-mixed: matmuls in bfloat16 under torch.autocast, weights and optimiser in float32 "
                        "(faster on CPUs with AVX512-BF16); float32: all of it in float32")


def _data_args(p: argparse.ArgumentParser) -> None:
    add_model_positional(p)
    p.add_argument("--model", default="smollm2-135m-instruct", help="the target: a built-in name, .gguf or HF directory")
    p.add_argument("--texts", default=None, help="JSONL (\"text\", \"prompt\" or \"messages\") or a text file; default: "
                                                 "the installed Python packages' sources and documentation")
    p.add_argument("--data", default=None, help="the data directory (default: $QUICKDRAFT_CACHE/heads/<target>/data)")
    add_flag(p, "--num-label-tokens", type=int, default=200_000, deprecated=("--max-tokens",),
             help="tokens of text to label")
    p.add_argument("--seq-len", type=int, default=512, help="tokens a window")
    add_dtype_arg(p, help="the target's, for labelling")
    p.add_argument("--quantization", default="auto", choices=["auto", "gguf", "none"])


def _load(args):
    import torch

    from quickdraft.models.loader import load_model

    return load_model(args.model, getattr(torch, args.dtype), quantization=args.quantization)


def _data_dir(args, model) -> Path:
    from quickdraft.proposers.heads.common import default_dir

    return Path(args.data).expanduser() if args.data else default_dir(model, "data")


def _data(args) -> int:
    from quickdraft.train import data

    model = _load(args)
    started = time.perf_counter()
    out = data.build(model, _data_dir(args, model), args.texts, args.seq_len, args.num_label_tokens)
    m = data.read_manifest(out)
    print(json.dumps({"data": str(out), "windows": m.num_windows, "source": m.source,
                      "seconds": round(time.perf_counter() - started, 1)}))
    return 0


def _generate(args) -> int:
    from quickdraft.llm import LLM
    from quickdraft.proposers.heads.common import default_dir
    from quickdraft.train import generate

    llm = LLM(args.model, speculative_config=args.speculative_config, max_num_seqs=args.batch_size)
    prompts = generate.read_prompts(args.prompts) if args.prompts else generate.default_prompts(args.num_prompts)
    prompts = prompts[: args.num_prompts]
    out = (Path(args.output_file).expanduser() if args.output_file
           else default_dir(llm.engine.model, "generated") / "answers.jsonl")
    started = time.perf_counter()
    made = generate.generate(llm, prompts, out, args.max_tokens, args.batch_size)
    seconds = time.perf_counter() - started
    print(json.dumps({"texts": str(out), "prompts": len(prompts), "generated_tokens": made, "seconds": round(seconds, 1),
                      "tokens_per_second": round(made / seconds, 1)}))
    print(f"label them: quickdraft train data --model {args.model} --texts {out}", file=sys.stderr)
    return 0


def _train(args) -> int:
    from quickdraft.proposers.heads.common import default_dir
    from quickdraft.train import data

    model = _load(args)
    data_dir = _data_dir(args, model)
    data.build(model, data_dir, args.texts, args.seq_len, args.num_label_tokens)  # resumes; nothing to do when done
    windows = data.load_windows(data_dir, model)
    out = Path(args.output_dir).expanduser() if args.output_dir else default_dir(model, args.method)
    manifest = data.read_manifest(data_dir)
    extra = {"data_source": manifest.source}
    started = time.perf_counter()
    if args.method == "eagle3":
        from quickdraft.train import eagle3

        _, losses = eagle3.train(model, windows, out, args.steps, args.draft_vocab_size, args.ttt_steps,
                                 args.batch_size, args.lr, args.seed, extra=extra,
                                 mixed=args.precision == "bf16-mixed")
    else:
        from quickdraft.train import medusa

        _, losses = medusa.train(model, windows, out, args.steps, args.num_heads, args.draft_vocab_size,
                                 args.batch_size, args.lr, args.seed, extra=extra,
                                 mixed=args.precision == "bf16-mixed")
    tail = losses[-50:]
    print(json.dumps({"head": str(out), "method": args.method, "steps": len(losses),
                      "loss_first": losses[0] if losses else None, "loss_last50": sum(tail) / max(len(tail), 1),
                      "seconds": round(time.perf_counter() - started, 1)}))
    print(f'use it: --speculative-config \'{{"method": "{args.method}", "num_speculative_tokens": 4}}\' '
          f"--model {args.model}", file=sys.stderr)
    return 0


def _draft(args) -> int:
    import torch

    from quickdraft.models.loader import load_model
    from quickdraft.proposers.heads.common import default_dir
    from quickdraft.train import data, draft

    from quickdraft.proposers.draft.load import check_same_vocabulary

    model = _load(args)
    stock = load_model(args.draft_model, torch.float32, quantization="none")  # dense weights to train
    # the pair is checked before the target labels anything: a wrong pair fails in seconds, not after the labelling
    check_same_vocabulary(model, stock)
    draft.check_trainable(stock.config)
    keep = _kept_layers(args.draft_layers, stock.config.num_layers)
    if keep is not None:
        draft.TrainableDraft(stock, keep)  # a wrong list fails here, before the labelling
    data_dir = _data_dir(args, model)
    data.build(model, data_dir, args.texts, args.seq_len, args.num_label_tokens)
    windows = data.load_windows(data_dir, model)
    out = Path(args.output_dir).expanduser() if args.output_dir else default_dir(model, "draft")
    started = time.perf_counter()
    lr = args.lr if args.lr is not None else (1e-3 if args.lora_rank > 0 else 2e-5)
    targets = args.lora_targets.split(",") if args.lora_targets else draft.LORA_TARGETS
    _, losses = draft.train(model, stock, windows, out, args.steps, args.batch_size, lr, args.seed,
                            mixed=args.precision == "bf16-mixed", lora_rank=args.lora_rank,
                            lora_alpha=args.lora_alpha, lora_targets=targets, keep_layers=keep)
    tail = losses[-50:]
    print(json.dumps({"draft": str(out), "lora_rank": args.lora_rank, "kept_layers": keep, "steps": len(losses),
                      "kl_first": losses[0] if losses else None,
                      "kl_last50": sum(tail) / max(len(tail), 1), "seconds": round(time.perf_counter() - started, 1)}))
    print(f'use it: --speculative-config \'{{"method": "draft_model", "model": "{out}"}}\' --model {args.model}',
          file=sys.stderr)
    return 0


def _kept_layers(value: str | None, num_layers: int) -> list[int] | None:
    """--draft-layers: None (all), N (evenly spaced) or the indices to keep."""
    from quickdraft.errors import ConfigError
    from quickdraft.train.draft import spread_layers

    if value is None:
        return None
    try:
        numbers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--draft-layers takes a count or comma-separated layer indices, got {value!r}",
                          "draft_layers") from None
    return spread_layers(num_layers, numbers[0]) if len(numbers) == 1 and "," not in value else numbers
