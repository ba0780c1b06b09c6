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
