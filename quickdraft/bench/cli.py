"""``quickdraft bench``: methods x settings against ``none`` on real prompt sets, peers beside them.

    quickdraft bench --suite quick --result-dir bench-out/quick
    quickdraft bench accuracy --model qwen2.5-coder-1.5b-instruct --num-prompts 10   # bench/accuracy.py
    quickdraft bench qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \\
        --methods none,ngram,draft_model --num-speculative-tokens-list 2,4,6,8 --datasets humaneval,mtbench \\
        --num-prompts 10 --max-tokens 128 --result-dir bench-out/mine

The model comes first (``quickdraft bench MODEL ...``, ``quickdraft bench MODEL accuracy ...``)
or as --model. A suite fills in every flag the command line leaves out; flags given win.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time

from quickdraft.errors import ConfigError

QWEN15, QWEN05 = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"

# the speculative config's keys that a Variant holds in its own fields; any other key of
# --speculative-config's variant goes into Variant.options
VARIANT_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "adaptive",
                "num_branches", "cross_tokenizer"}
DEFAULTS = {
    "model": "smollm2-135m-instruct", "draft_model": None, "datasets": "humaneval", "num_prompts": 10,
    "categories": None, "max_tokens": 128, "temperature": 0.0, "seed": 0, "num_seeds": None, "repeats": 1,
    "methods": "none,ngram", "num_speculative_tokens": "4", "prompt_lookup_max": "4", "prompt_lookup_min": "2",
    "num_branches": "1", "adaptive": True, "peers": "none", "peer_num_speculative_tokens": 4, "warmup_tokens": 8, "max_model_len": 2048,
    "peer_timeout": 1800,
}
SUITES = {
    # about 5 minutes here: 2 HumanEval prompts and 2 MT-Bench questions (4 turns), 64 tokens
    "quick": {"model": QWEN15, "draft_model": QWEN05, "datasets": "humaneval,mtbench", "num_prompts": 2,
              "max_tokens": 64, "methods": "none,ngram,draft_model", "num_speculative_tokens": "4",
              "peers": "llama_cpp,llama_server"},
    # the figures of docs/benchmarks/archive/bf16-standard-suite, 50.5 minutes on a 2-core AMD EPYC: 4 HumanEval prompts and one
    # MT-Bench question of each of its 8 categories (16 turns), 96 tokens, K = 2, 4, 6, 8, peers (llama_server added since)
    "standard": {"model": QWEN15, "draft_model": QWEN05, "datasets": "humaneval,mtbench",
                 "num_prompts": "humaneval=4,mtbench=8", "max_tokens": 96, "methods": "none,ngram,draft_model",
                 "num_speculative_tokens": "2,4,6,8", "peers": "transformers,llama_cpp,llama_server"},
}
FLAGS = {  # setting -> its flag, in the order the reproducing command lists them
    "model": "--model", "draft_model": "--draft-model", "datasets": "--datasets", "num_prompts": "--num-prompts",
    "categories": "--categories", "max_tokens": "--max-tokens", "temperature": "--temperature", "seed": "--seed",
    "num_seeds": "--num-seeds", "repeats": "--repeats", "methods": "--methods",
    "num_speculative_tokens": "--num-speculative-tokens-list", "prompt_lookup_max": "--prompt-lookup-max",
    "prompt_lookup_min": "--prompt-lookup-min", "num_branches": "--num-branches", "adaptive": "--adaptive", "peers": "--peers",
    "peer_num_speculative_tokens": "--peer-num-speculative-tokens", "warmup_tokens": "--warmup-tokens",
    "max_model_len": "--max-model-len", "peer_timeout": "--peer-timeout",
}


def register(subparsers) -> None:
    from quickdraft.arguments import add_flag, add_model_args, add_switch

    p = subparsers.add_parser("bench", help="benchmark speculative methods against plain decoding, and peers",
                              usage="quickdraft bench [MODEL] [options]\n       quickdraft bench [MODEL] accuracy [options]",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, positional=False, shorthands=False, max_model_len="2048")  # a sub-command (accuracy) comes first; its own --draft-model and --num-speculative-tokens-list
    p.set_defaults(model=None, func=run)
    p.add_argument("--suite", choices=sorted(SUITES),
                   help="a preset: quick (2 prompts of each set, 64 tokens, K=4) or standard (K=2..8, both peers)")
    p.add_argument("--draft-model", help="the draft of method draft_model (a built-in name, .gguf or HF directory)")
    p.add_argument("--datasets", help="comma-separated: humaneval, mtbench, or .jsonl files")
    add_flag(p, "--num-prompts", deprecated=("--limit",),
             help="prompts per data set, taken round-robin over its categories (0 = all); one number, or per set: "
                  "humaneval=4,mtbench=8")
    p.add_argument("--categories", help="comma-separated categories to keep (e.g. coding,math)")
    p.add_argument("--max-tokens", type=int, help="tokens to generate a request, at most (default 128)")
    p.add_argument("--temperature", type=float, help="0 = greedy; > 0 compares token distributions over seeds")
    p.add_argument("--seed", type=int, help="the first seed")
    p.add_argument("--num-seeds", type=int, help="samples per request and variant at temperature > 0 (default 32)")
    p.add_argument("--repeats", type=int, help="runs of each request by each variant (greedy)")
    p.add_argument("--methods", help="comma-separated: none, ngram, draft_model, suffix, eagle3, medusa, layer_skip (none is always run)")
    add_flag(p, "--num-speculative-tokens-list", dest="num_speculative_tokens", deprecated=("--num-speculative-tokens",),
             help="the values of K to measure, comma-separated (e.g. 2,4,6,8): each is a variant of each method")
    p.add_argument("--prompt-lookup-max", help="ngram: longest n-gram sizes, comma-separated")
    p.add_argument("--prompt-lookup-min", help="ngram: shortest n-gram sizes, comma-separated")
    p.add_argument("--num-branches", help="ngram, suffix, draft_model: 1 (chains), or more to draft token trees "
                                          "(e.g. 1,3: chains and trees side by side)")
    add_switch(p, "--adaptive", default=None, values=("true,false", "false,true"),
               help="K planned per step, up to each K (the default); --no-adaptive: always K. To compare both, "
                    "add a variant with \"adaptive\": false through --speculative-config")
    p.add_argument("--peers", help="comma-separated: transformers, llama_cpp, llama_server (llama.cpp's own server "
                                   "and speculation: make llama-server), or none")
    p.add_argument("--peer-num-speculative-tokens", type=int, help="K of the peers' speculative methods")
    p.add_argument("--peer-timeout", type=float,
                   help="seconds each peer may run in its own process before it is killed and noted (default 1800)")
    p.add_argument("--warmup-tokens", type=int)
    add_switch(p, "--ignore-eos", help="always generate --max-tokens tokens")
    add_flag(p, "--result-dir", deprecated=("--out",), help="write results.json, report.md and PNG plots into this folder")
    add_switch(p, "--progress", default=True, help="a progress bar")
    # `quickdraft bench accuracy ...`: its own flags, after the word (plain `quickdraft bench` is unchanged)
    from quickdraft.bench import accuracy

    accuracy.register(p.add_subparsers(dest="bench_command", metavar="{accuracy}"))


def _ints(value: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in str(value).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers, got {value!r}") from None


def _bools(value, flag: str) -> tuple[bool, ...]:
    """--adaptive's setting: True or False (the switch), a tuple of both (the old true,false sweep),
    or the old words."""
    if isinstance(value, bool):
        return (value,)
    if isinstance(value, tuple) and value and all(isinstance(v, bool) for v in value):
        return value
    words = {"true": True, "false": False}
    names = _names(value)
    if not names or any(n.lower() not in words for n in names):
        raise ConfigError(f"{flag} takes no value ({flag} or --no-{flag[2:]}), got {value!r}")
    return tuple(dict.fromkeys(words[n.lower()] for n in names))


def _limits(value, data: list[str]) -> dict[str, int | None]:
    """``--num-prompts``: "8" for every data set, or "humaneval=4,mtbench=8" (unnamed sets: all)."""
    text = str(value if value is not None else 0)
    try:
        if "=" not in text:
            return {d: int(text) or None for d in data}
        named = {k.strip(): int(v) or None for k, v in (part.split("=", 1) for part in text.split(",") if part.strip())}
    except ValueError:
        raise ConfigError(f"--num-prompts takes a number or name=number pairs, got {value!r}", "num_prompts") from None
    unknown = sorted(set(named) - set(data))
    if unknown:
        raise ConfigError(f"--num-prompts names data sets not in --datasets: {unknown}", "num_prompts")
    return {d: named.get(d) for d in data}


def _names(value) -> list[str]:
    return [x.strip() for x in str(value).split(",") if x.strip()] if value else []


def resolve(args) -> dict:
    """Explicit flags, else the suite's preset, else the defaults."""
    settings = dict(DEFAULTS)
    if args.suite:
        settings.update(SUITES[args.suite])
    for key in DEFAULTS:
        if getattr(args, key, None) is not None:
            settings[key] = getattr(args, key)
    if settings["temperature"] and settings["num_seeds"] is None:
        settings["num_seeds"] = 32
    return settings


def command_line(settings: dict, args) -> str:
    """The command that reruns exactly this benchmark, every setting spelled out."""
    parts = ["quickdraft", "bench"]
    for key, flag in FLAGS.items():
        value = settings.get(key)
        if isinstance(value, tuple) and key == "adaptive":  # both: the old sweep's words
            parts += [flag, ",".join(str(v).lower() for v in value)]
        elif isinstance(value, bool):  # a switch
            parts.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            parts += [flag, str(value)]
    parts += ["--dtype", args.dtype, "--device", args.device]
    if args.quantization:
        parts += ["--quantization", args.quantization]
    if args.ignore_eos:
        parts.append("--ignore-eos")
    if args.speculative_config:
        parts += ["--speculative-config", args.speculative_config]
    if args.result_dir:
        parts += ["--result-dir", args.result_dir]
    return shlex.join(parts)


def _configs(text: str | None) -> list[dict]:
    """--speculative-config's variants: one JSON object, or a list of them (one variant each)."""
    if not text:
        return []
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config is not valid JSON: {e}", "speculative_config") from None
    given = given if isinstance(given, list) else [given]
    if not all(isinstance(g, dict) for g in given):
        raise ConfigError("--speculative-config must be a JSON object or a list of objects", "speculative_config")
    return given


def build_config(settings: dict, args):
    from quickdraft.bench.harness import BenchConfig, Variant, variants
    from quickdraft.bench.peers import PEERS
    from quickdraft.config import METHODS, SpeculativeConfig
    from quickdraft.evaluation.datasets import BUILTIN

    methods = _names(settings["methods"])
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ConfigError(f"unknown method(s) {bad}; valid: {', '.join(METHODS)}", "methods")
    if "draft_model" in methods and not settings["draft_model"]:
        raise ConfigError("method draft_model needs --draft-model", "draft_model")
    ks = _ints(settings["num_speculative_tokens"], "--num-speculative-tokens")
    for k in ks:
        SpeculativeConfig(method="ngram", num_speculative_tokens=k)  # validates K
    vs = variants(methods, ks, settings["draft_model"], _ints(settings["prompt_lookup_max"], "--prompt-lookup-max"),
                  _ints(settings["prompt_lookup_min"], "--prompt-lookup-min"), _bools(settings["adaptive"], "--adaptive"),
                  _ints(settings["num_branches"], "--num-branches"))
    for b in {v.branches for v in vs}:
        SpeculativeConfig(method="ngram", num_branches=b)  # validates the branch count
    for given in _configs(args.speculative_config):  # each its own variant
        s = SpeculativeConfig.parse(given)
        if s.enabled:
            # a draft model is loaded once and shared; any other method's "model" (a trained head's
            # directory) goes to its engine as given
            draft = s.model if s.method == "draft_model" else None
            options = tuple(sorted((k, v) for k, v in given.items()
                                   if k not in VARIANT_KEYS or (k == "model" and draft is None)))
            vs.append(Variant(s.method, s.num_speculative_tokens,
                              s.prompt_lookup_max if s.method == "ngram" else None,
                              s.prompt_lookup_min if s.method == "ngram" else None, draft, s.adaptive,
                              s.num_branches, s.cross_tokenizer, options))
    vs = list(dict.fromkeys(vs))
    if len({v.draft for v in vs if v.method == "draft_model" and not v.cross_tokenizer}) > 1:
        # several drafts compared: each draft_model variant is named by its draft, or two would
        # share a name (and one engine's results would overwrite the other's)
        vs = [dataclasses.replace(v, named_draft=True) if v.method == "draft_model" else v for v in vs]
    names = [v.name for v in vs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"variants {twice} would share a name: give their models paths that end in different "
                          "names", "speculative_config")
    peers = [p for p in _names(settings["peers"]) if p != "none"]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise ConfigError(f"unknown peer(s) {bad}; valid: {', '.join(PEERS)}, none", "peers")
    if float(settings["peer_timeout"]) <= 0:
        raise ConfigError(f"--peer-timeout must be > 0 seconds, got {settings['peer_timeout']}", "peer_timeout")
    data = _names(settings["datasets"])
    bad = [d for d in data if d not in BUILTIN and not d.endswith(".jsonl") and not os.path.isfile(d)]
    if bad:
        raise ConfigError(f"unknown data set(s) {bad}: use {', '.join(BUILTIN)} or .jsonl files", "datasets")
    if settings["temperature"] and settings["num_seeds"] < 2:
        raise ConfigError("--num-seeds must be >= 2 at temperature > 0 (a distribution needs samples)", "num_seeds")
    return BenchConfig(
        model=settings["model"], variants=vs, datasets=data, limit=_limits(settings["num_prompts"], data),
        categories=_names(settings["categories"]) or None, max_tokens=settings["max_tokens"],
        temperature=settings["temperature"], seed=settings["seed"], num_seeds=settings["num_seeds"] or 1,
        repeats=settings["repeats"], warmup_tokens=settings["warmup_tokens"], ignore_eos=args.ignore_eos,
        dtype=args.dtype, device=args.device, quantization=args.quantization, max_model_len=settings["max_model_len"], peers=peers,
        peer_k=settings["peer_num_speculative_tokens"], peer_timeout=float(settings["peer_timeout"]),
    )


def run(args) -> int:
    from pathlib import Path

    from quickdraft.bench import report
    from quickdraft.bench.harness import Harness
    from quickdraft.bench.summary import summarize
    from quickdraft.evaluation.measure import machine, versions

    started = time.time()
    settings = resolve(args)
    config = build_config(settings, args)
    result = {"schema_version": 1, "command": command_line(settings, args), "argv": list(sys.argv),
              "machine": machine(), "versions": versions()}
    result.update(Harness(config, progress=args.progress).run())
    result["summary"] = summarize(result)
    result["duration_s"] = time.time() - started
    print(report.terminal(result))
    if args.result_dir:
        written = report.write(result, Path(args.result_dir))
        print(f"\nwrote {', '.join(str(p) for p in written.values())}")
    print(f"took {(time.time() - started) / 60:.1f} min")
    return 0
