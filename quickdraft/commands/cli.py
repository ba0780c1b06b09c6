"""``quickdraft generate | models | serve | bench | profile | check | fidelity | train | advise``: one module
a subcommand, each with its ``register(subparsers)``; flags named like ``vllm serve``'s where they
exist (arguments.py holds the shared ones).

A mistake of the user's (a QuickdraftError) prints one clear line and exits with code 2; only a
bug shows a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from quickdraft.arguments import resolve_model_args, show_defaults
from quickdraft.engine.threads import set_threads
from quickdraft.errors import QuickdraftError

# in the order `quickdraft --help` lists them
COMMANDS = ("quickdraft.commands.generate", "quickdraft.commands.models", "quickdraft.commands.serve",
            "quickdraft.bench.cli", "quickdraft.commands.profile", "quickdraft.commands.check",
            "quickdraft.commands.fidelity", "quickdraft.train.cli", "quickdraft.commands.advise")


def build_parser() -> argparse.ArgumentParser:
    from quickdraft import __version__

    parser = argparse.ArgumentParser(prog="quickdraft", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"quickdraft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    show_defaults(parser)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, options allowed anywhere among a command's positionals
    (``quickdraft generate MODEL --max-tokens 16 "prompt"``): the command's own parser, found by the
    sub-command names that come first, parses them intermixed (argparse's
    ``parse_intermixed_args``); a command with sub-commands of its own past that point, or no
    command, is parsed as usual."""
    argv = list(sys.argv[1:] if argv is None else argv)
    node, named, defaults, model = parser, [], {}, None
    while True:
        subs = [a for a in node._actions if isinstance(a, argparse._SubParsersAction)]
        at = len(named)
        if subs and model is None and named and _model_first(node, argv[at:]):
            # `quickdraft bench MODEL [accuracy] ...`: a command with sub-commands of its own takes
            # the model before them, as the others take it first
            model = argv.pop(at)
        if not subs or at >= len(argv) or argv[at] not in subs[0].choices:
            break
        named.append((subs[0].dest, argv[at]))
        defaults |= node._defaults
        node = subs[0].choices[argv[at]]
    if not named or any(isinstance(a, argparse._SubParsersAction) for a in node._actions):
        args = parser.parse_args(argv)
    else:
        args = node.parse_intermixed_args(argv[len(named):])
        for dest, name in named:
            setattr(args, dest, name)
        for key, value in defaults.items():
            if not hasattr(args, key):
                setattr(args, key, value)
    if model is not None:
        if getattr(args, "model_positional", None) not in (None, model):
            parser.error(f"two models named: {model} and {args.model_positional}; name one")
        args.model_positional = model
    return args


def _model_first(node: argparse.ArgumentParser, rest: list[str]) -> bool:
    """Whether ``rest`` starts with a model rather than one of ``node``'s sub-commands or a flag:
    ``node`` takes --model, and the word is no sub-command's name."""
    subs = [a for a in node._actions if isinstance(a, argparse._SubParsersAction)]
    takes_model = any("--model" in a.option_strings for a in node._actions)
    return (takes_model and bool(rest) and not rest[0].startswith("-") and rest[0] not in subs[0].choices)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
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
