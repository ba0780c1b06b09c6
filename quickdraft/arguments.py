"""The command line's shared vocabulary: the model and sampling flags, switches, deprecated
spellings and the help formatter, for every parser (``quickdraft`` and its subcommands, the
server's, the load generator's).

It sits below the commands and imports none of them, so that a server replica building its
``serve`` arguments (server/cli.py) loads no other command.

One name per concept, vLLM's where it has one: ``--draft-model``, ``--num-speculative-tokens``,
``--num-prompts``, ``--num-seeds``, ``--batch-size`` (a comma-separated list where a command
measures several), ``--max-tokens`` (generated tokens, always), ``--result-dir`` (a folder of
results and reports), ``--output-dir`` (a trained model's folder), ``--output-file`` (a file);
every switch is ``--flag/--no-flag``. An old spelling keeps working for one release and prints
one line saying the new one (``add_flag``'s ``deprecated``).
"""

from __future__ import annotations

import argparse
import sys

from quickdraft.errors import ConfigError

DEFAULT_MODEL = "smollm2-135m-instruct"
WORDS = {"true": True, "false": False}


def deprecation(old: str, new: str) -> None:
    """The one line an old spelling prints, to stderr."""
    print(f"quickdraft: {old} is deprecated and goes in the next release; use {new}", file=sys.stderr)


class _Renamed(argparse.Action):
    """An old flag: says so, then does what the new flag's action does."""

    def __init__(self, option_strings, dest, target: argparse.Action, **kwargs):
        super().__init__(option_strings, dest, nargs=target.nargs, type=target.type, choices=target.choices,
                         metavar=target.metavar, help=argparse.SUPPRESS)
        self.target = target

    def __call__(self, parser, namespace, values, option_string=None):
        new = self.target.option_strings[0]
        if isinstance(self.target, argparse.BooleanOptionalAction):  # --old / --no-old -> --new / --no-new
            negated = option_string.startswith("--no-")
            new = self.target.option_strings[1 if negated else 0]
        deprecation(option_string, new)
        self.target(parser, namespace, values, new)


def add_flag(p, *names: str, deprecated: tuple[str, ...] = (), **kwargs) -> argparse.Action:
    """``p.add_argument(*names, **kwargs)``, and each ``deprecated`` spelling as a hidden alias
    that prints a deprecation line naming ``names[0]`` and then acts as it."""
    action = p.add_argument(*names, **kwargs)
    for old in deprecated:
        olds = [old]
        if isinstance(action, argparse.BooleanOptionalAction):
            olds.append("--no-" + old[2:])
        p.add_argument(*olds, dest=action.dest, action=_Renamed, target=action)
    return action


class Switch(argparse.BooleanOptionalAction):
    """``--flag/--no-flag``. With ``values``, the old ``--flag true|false`` form is still taken,
    with a deprecation line (``values`` names the words taken beside true and false, e.g.
    ``("true,false",)`` for a sweep of both, stored as the tuple (True, False))."""

    def __init__(self, option_strings, dest, values: tuple[str, ...] | None = None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.values = values
        if values is not None:
            self.nargs = "?"  # the old form's word, if one follows

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None or values == []:
            return super().__call__(parser, namespace, values, option_string)
        word = str(values).strip().lower()
        if option_string.startswith("--no-") or (word not in WORDS and word not in self.values):
            parser.error(f"{option_string} takes no value (got {values!r}): use {self.option_strings[0]} "
                         f"or {self.option_strings[1]}")
        if word in WORDS:
            deprecation(f"{option_string} {values}", self.option_strings[0 if WORDS[word] else 1])
            setattr(namespace, self.dest, WORDS[word])
        else:
            deprecation(f"{option_string} {values}", f"{self.option_strings[0]} or {self.option_strings[1]}")
            setattr(namespace, self.dest, tuple(dict.fromkeys(WORDS[w.strip()] for w in word.split(","))))


def add_switch(p, name: str, default: bool | None = False, help: str | None = None,
               deprecated: tuple[str, ...] = (), values: tuple[str, ...] | None = None) -> argparse.Action:
    """A ``--name/--no-name`` switch (``Switch``); ``values``: the old ``--name true|false`` form is
    taken too (only for flags that had it: the word after the flag is read as its value)."""
    kwargs = {"values": values} if values is not None else {}
    return add_flag(p, name, action=Switch, default=default, help=help, deprecated=deprecated, **kwargs)


def add_model_positional(p: argparse.ArgumentParser) -> None:
    """MODEL as the first positional, as ``vllm serve MODEL`` takes it; ``resolve_model_args``
    makes it ``args.model`` (naming two different models is an error)."""
    p.add_argument("model_positional", nargs="?", default=None, metavar="MODEL", help="the model, as --model takes it")


def add_model_args(p: argparse.ArgumentParser, positional: bool = True, shorthands: bool = True,
                   max_model_len: str | None = None) -> None:
    """The model and speculative flags shared by generate, serve, profile, check and bench;
    ``positional``: the model may also come first, as ``vllm serve MODEL`` takes it
    (``resolve_model_args``; generate reads its own words).
    ``--draft-model`` and ``--num-speculative-tokens`` are shorthands for the speculative config's
    ``model`` and ``num_speculative_tokens`` (``speculative_config``); a command that sweeps them
    (bench) passes ``shorthands=False`` and names its own. ``max_model_len``: the command's own
    default for --max-model-len, in words, where it is not serve's."""
    if positional:
        add_model_positional(p)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a built-in name (see `quickdraft models`), a .gguf file or a Hugging Face directory")
    p.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; methods: none, ngram, '
                        "draft_model, suffix, eagle3, medusa, layer_skip")
    if shorthands:
        p.add_argument("--draft-model", default=None,
                       help="the draft model: shorthand for the speculative config's method draft_model and its model")
        p.add_argument("--num-speculative-tokens", type=int, default=None,
                       help="K: shorthand for the speculative config's num_speculative_tokens")
    else:
        p.set_defaults(speculative_shorthands=False)
    add_dtype_arg(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--quantization", default="auto", choices=["auto", "gguf", "none"],
                   help="gguf: run a GGUF model on its stored block-quantized weights (Q4_K, Q6_K, Q8_0, ...), "
                        "--dtype being the activations'; none: dequantize them to --dtype; auto (default): gguf "
                        "where quickdraft's CPU kernels run (see `quickdraft check`), else none")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens a sequence may hold, prompt and output (default: the model's context length, less "
                        "where the KV cache of --max-num-seqs sequences, allocated up front, would not fit in the "
                        "memory free after the weights, or on a CPU in 4 GiB (QUICKDRAFT_CPU_KV_SPACE); one line says which). More than the model's context, or "
                        "than the memory holds, is an error" if max_model_len is None else
                        f"tokens a sequence may hold, prompt and output (default: {max_model_len})")
    add_switch(p, "--enforce-eager",
               help="on a CUDA device, run every pass eagerly: no CUDA graphs for the decoding passes "
                    "(they take a little memory and a capture on each new shape; default: off)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the model (default: one per physical core this process may run on); "
                        "and fewer while other processes keep cores busy; OpenMP threads spin while they wait, "
                        "unless $OMP_WAIT_POLICY or $GOMP_SPINCOUNT says otherwise")


def add_dtype_arg(p, help: str = "the activations' (and dense weights') dtype; auto: bfloat16 on the CPU kernels"):
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"], help=help)


def speculative_config(args: argparse.Namespace):
    """--speculative-config (JSON text or None) with the --draft-model and --num-speculative-tokens
    shorthands folded in: a draft model alone means method draft_model; a shorthand that
    contradicts the JSON is an error. -> what SpeculativeConfig.parse takes (None, text or a dict)."""
    import json

    raw = getattr(args, "speculative_config", None)
    draft, k = getattr(args, "draft_model", None), getattr(args, "num_speculative_tokens", None)
    if draft is None and k is None:
        return raw
    try:
        given = json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config is not valid JSON: {e}", "speculative_config") from None
    if not isinstance(given, dict):
        raise ConfigError("--speculative-config must be one JSON object here", "speculative_config")
    config = dict(given)
    for key, flag, value in (("model", "--draft-model", draft), ("num_speculative_tokens", "--num-speculative-tokens", k)):
        if value is None:
            continue
        if key in given and given[key] != value:
            raise ConfigError(f"{flag} {value} and the speculative config's {key} {given[key]!r} differ: give one",
                              key)
        config[key] = value
    if draft is not None:
        if config.setdefault("method", "draft_model") != "draft_model":
            raise ConfigError(f"--draft-model is the draft of method draft_model, not {config['method']!r}",
                              "draft_model")
    elif "method" not in config:
        raise ConfigError("--num-speculative-tokens needs a method: --draft-model or --speculative-config",
                          "num_speculative_tokens")
    return json.dumps(config)


def _is_model(name: str) -> bool:
    """Whether ``name`` is a model quickdraft can load: a built-in name, a .gguf file or a directory."""
    from pathlib import Path

    from quickdraft.models import registry

    path = Path(name).expanduser()
    return registry.is_builtin(name) or path.is_dir() or (path.is_file() and path.suffix == ".gguf")


def resolve_model_args(args: argparse.Namespace) -> argparse.Namespace:
    """The model named first (``quickdraft serve MODEL``) or with --model, --dtype auto as the
    dtype it means, and the speculative shorthands folded into --speculative-config; two
    different models named is an error."""
    named = getattr(args, "model_positional", None)
    served = getattr(args, "served_model_name", None)
    if named is None and served and len(served) > 1 and args.model == DEFAULT_MODEL and _is_model(served[-1]):
        # `serve --served-model-name NAME MODEL`: the option's list took the model named after it
        named, args.served_model_name = served[-1], served[:-1]
    if named is not None:
        if args.model not in (None, DEFAULT_MODEL, named):  # None: the command's own default (bench)
            raise ConfigError(f"two models named: {named} and --model {args.model}; name one", "model")
        args.model = named
    if getattr(args, "dtype", None) == "auto":
        args.dtype = "bfloat16"
    if hasattr(args, "speculative_config") and getattr(args, "speculative_shorthands", True):
        args.speculative_config = speculative_config(args)
        args.draft_model = args.num_speculative_tokens = None  # folded in: resolving twice changes nothing
    return args


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate, at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the likeliest tokens up to this mass (1: all)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    p.add_argument("--seed", type=int, default=None)


def numbers(text: str, kind, flag: str) -> list:
    """A comma-separated list of numbers of ``kind``."""
    try:
        return [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated numbers, got {text!r}") from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows every flag's default in ``--help`` (argparse's ArgumentDefaultsHelpFormatter, but silent
    where there is nothing to show: a default of None, a switch's False, or a help that states it),
    keeping descriptions as written; a switch reads ``--flag, --no-flag``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        # by identity: a default of 0 or 0.0 equals False, and is worth showing
        shown = all(action.default is not v for v in (None, False, argparse.SUPPRESS)) and action.option_strings
        if shown and "%(default)" not in help and "default" not in help.lower():
            help += (" " if help else "") + "(default: %(default)s)"
        return help

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, Switch):
            return ", ".join(action.option_strings)
        return super()._format_action_invocation(action)

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if isinstance(action, Switch):  # the old value form is not shown
            return ""
        return super()._format_args(action, default_metavar)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every subcommand under it the HelpFormatter; a flag without a help text
    gets one that shows its default (each command registers its own parser, so this runs once over
    the finished tree)."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:  # argparse keeps subcommands in a private action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
        elif action.help is None and action.option_strings and action.default is not None and action.default is not False:
            # (by identity: 0 and 0.0 equal False, and their defaults are worth showing)
            action.help = "(default: %(default)s)"
