"""``quickdraft generate | models | serve | bench | profile | check | train``: flags named like ``vllm serve``'s where they exist.

A mistake of the user's (a QuickdraftError) prints one clear line and exits with code 2; only a
bug shows a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from quickdraft.engine.threads import set_threads
from quickdraft.errors import ConfigError, QuickdraftError


DEFAULT_MODEL = "smollm2-135m-instruct"


def add_model_args(p: argparse.ArgumentParser, positional: bool = False) -> None:
    """The model and speculative flags shared by generate, serve and bench; ``positional``: the
    model may also come first, as ``vllm serve MODEL`` takes it (``resolve_model_args``)."""
    if positional:
        p.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                       help="the model, as --model takes it")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a built-in name (see `quickdraft models`), a .gguf file or a Hugging Face directory")
    p.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; methods: none, ngram, draft_model, suffix, eagle3, medusa, layer_skip')
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"],
                   help="the activations' (and dense weights') dtype; auto: bfloat16 on the CPU kernels")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--quantization", default="auto", choices=["auto", "gguf", "none"],
                   help="gguf: run a GGUF model on its stored block-quantized weights (Q4_K, Q6_K, Q8_0, ...), "
                        "--dtype being the activations'; none: dequantize them to --dtype; auto (default): gguf "
                        "where quickdraft's CPU kernels run (see `quickdraft check`), else none")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the model (default: one per physical core this process may run on); "
                        "OpenMP threads spin while they wait, or wait passively where the cores are busy already "
                        "(the load average), unless $OMP_WAIT_POLICY or $GOMP_SPINCOUNT says otherwise")


def resolve_model_args(args: argparse.Namespace) -> argparse.Namespace:
    """The model named first (``quickdraft serve MODEL``) or with --model, and --dtype auto as the
    dtype it means; two different models named is an error."""
    named = getattr(args, "model_positional", None)
    if named is not None:
        if args.model not in (DEFAULT_MODEL, named):
            raise ConfigError(f"two models named: {named} and --model {args.model}; name one", "model")
        args.model = named
    if getattr(args, "dtype", None) == "auto":
        args.dtype = "bfloat16"
    return args


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _generate(args) -> int:
    from quickdraft import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    if len(args.words) > 2:
        raise ConfigError(f"generate takes [MODEL] PROMPT, got {len(args.words)} words: quote the prompt", "prompt")
    *model, prompt = args.words
    if model:
        args.model_positional = model[0]
        resolve_model_args(args)
    llm = LLM(args.model, speculative_config=args.speculative_config, dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=1, quantization=args.quantization)
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    with llm:
        out = llm.generate([llm.tokenizer.encode(prompt)], params)[0]
    report = summarize(out, llm.engine.config.speculative)
    if args.json:
        print(json.dumps(report))
    else:
        print(out.text)
        s = report["spec"]
        print(
            f"\n[{report['num_generated_tokens']} tokens in {report['seconds']:.2f}s, "
            f"{report['tokens_per_second']:.2f} tok/s | {s['method']} K={s['num_speculative_tokens']}: "
            f"{s['num_target_passes']} target passes, accepted {s['num_accepted_tokens']}/{s['num_draft_tokens']} "
            f"({s['acceptance_rate']:.0%}), {s['mean_accepted_length']:.2f} tokens/pass]",
            file=sys.stderr,
        )
    return 0


def summarize(out, spec) -> dict:
    """The JSON report of one request. ``seconds`` runs from the first token (the prompt pass
    emits it) to the last, so tokens_per_second counts the tokens after the first."""
    seconds = (out.finish_time or time.perf_counter()) - (out.first_token_time or out.arrival_time)
    n = len(out.token_ids)
    stats = out.spec.to_dict()
    return {
        "text": out.text, "token_ids": out.token_ids, "num_prompt_tokens": len(out.prompt_token_ids),
        "num_generated_tokens": n, "finish_reason": out.finish_reason, "seconds": seconds,
        "tokens_per_second": (n - 1) / seconds if n > 1 and seconds > 0 else 0.0,
        "spec": {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens if spec.enabled else 0,
                 **stats},
    }


def _models(args) -> int:
    from quickdraft.models.registry import list_models

    rows = list_models()
    print(f"{'name':32} {'installed':10} {'size':>10}  packages")
    for r in rows:
        size = f"{r.size / 2**20:.0f} MiB" if r.size else "-"
        pkgs = r.packages[0] if len(r.packages) == 1 else f"{r.packages[0]} .. {r.packages[-1]} ({len(r.packages)})"
        print(f"{r.name:32} {'yes' if r.installed else 'no':10} {size:>10}  {pkgs}")
    return 0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows every flag's default in ``--help`` (argparse's ArgumentDefaultsHelpFormatter, but silent
    where there is nothing to show: a default of None, a switch's False, or a help that states it),
    keeping descriptions as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
        if shown and "%(default)" not in help and "default" not in help.lower():
            help += (" " if help else "") + "(default: %(default)s)"
        return help


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every subcommand under it the HelpFormatter; a flag without a help text
    gets one that shows its default (each command registers its own parser, so this runs once over
    the finished tree)."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:  # argparse keeps subcommands in a private action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
        elif action.help is None and action.option_strings and action.default not in (None, False):
            action.help = "(default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    from quickdraft import __version__

    parser = argparse.ArgumentParser(prog="quickdraft", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"quickdraft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("words", nargs="+", metavar="[MODEL] PROMPT",
                   help="the prompt, after the model where it comes first (else --model)")
    add_model_args(g)
    add_sampling_args(g)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=_generate)

    m = sub.add_parser("models", help="list the built-in models")
    m.set_defaults(func=_models)

    # The server and the bench register their own subcommands (their imports stay light).
    from quickdraft import advise, check, profile
    from quickdraft.bench import cli as bench_cli
    from quickdraft.server import cli as server_cli
    from quickdraft.train import cli as train_cli

    server_cli.register(sub)
    bench_cli.register(sub)
    profile.register(sub)
    check.register(sub)
    train_cli.register(sub)
    advise.register(sub)
    show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        resolve_model_args(args)
        if getattr(args, "threads", None) is not None:  # the commands with the model flags
            set_threads(args.threads)
        return args.func(args)
    except QuickdraftError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
