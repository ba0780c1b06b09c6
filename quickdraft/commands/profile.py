"""``quickdraft profile``: when does speculation pay on this machine, for this pair of models?

It times the target's pass (and the draft's, for ``draft_model``) by rows, as the engine does at
start-up (models/pass_cost.py), then asks the engine's own planner, for each batch size and each
acceptance rate, which K it would choose and what speedup over plain decoding the cost model
expects. The figures are predictions of the model from measured costs, not measured speedups:
``quickdraft bench`` and ``python -m quickdraft.bench.loadgen`` measure those.

Before the plan it says where the time goes (quickdraft/evaluation/measure.py): a one-row pass of the target
and of the draft against its floor (its weight bytes over the memory bandwidth measured here),
split into the layers' matrices, their attention, the rest of the layers, the rest of the pass
and the output head; and the engine's own time a decoding step, outside the models' passes, for a
greedy request and for a sampled one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

BATCHES = (1, 2, 4, 8, 16)
ALPHAS = (0.2, 0.4, 0.6, 0.7, 0.8, 0.9)
CONTEXT = 256  # tokens each sequence holds in the predictions
# weights under this many times the last-level cache may be partly read from it pass after pass
# (the 0.5B draft's 224 MiB beside an Intel Xeon's 300 MiB read at up to 145% of the memory's floor)
CACHE_HELD = 2
SAMPLED_TEMPERATURE = 0.7  # the sampled step's (engine_sampled)
SPLIT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."


def register(sub) -> None:
    from quickdraft.arguments import add_flag, add_model_args, add_switch

    p = sub.add_parser("profile", help="time this machine and say where speculation pays (K by batch and acceptance)")
    add_model_args(p, max_model_len="512")
    add_flag(p, "--batch-size", default=",".join(map(str, BATCHES)), deprecated=("--batch-sizes",),
             help="running sequences to predict for, comma-separated")
    p.add_argument("--acceptance-rates", default=",".join(map(str, ALPHAS)), help="comma-separated, in (0, 1)")
    add_switch(p, "--json", help="print one JSON object")
    p.add_argument("--plot", help="write a heat map of the expected speedup to this PNG")
    p.set_defaults(func=profile)


def predict(target, draft, k: int, batches, alphas, context: int = CONTEXT) -> list[dict]:
    """For each (batch, alpha): the planned K per sequence and the expected speedup over plain,
    for sequences ``context`` tokens long."""
    from quickdraft.engine.plan import plan_draft_lengths, step_rate

    rows = []
    for b in batches:
        for a in alphas:
            ctx = [context] * b
            ks = plan_draft_lengths([a] * b, [k] * b, target, draft, contexts=ctx)
            plain = step_rate([0] * b, [a] * b, target, draft, ctx)
            rows.append({"batch": b, "acceptance": a, "k": max(ks), "ks": ks,
                         "speedup": step_rate(ks, [a] * b, target, draft, ctx) / plain})
    return rows


def profile(args) -> int:
    from quickdraft.arguments import numbers
    from quickdraft.config import EngineConfig, SpeculativeConfig
    from quickdraft.engine.engine import Engine
    from quickdraft.errors import ConfigError

    spec = SpeculativeConfig.parse(args.speculative_config)
    if not spec.enabled:
        raise ConfigError('profile needs --speculative-config with a method (e.g. {"method": "ngram"})',
                          "speculative_config")
    batches = numbers(args.batch_size, int, "--batch-size")
    alphas = numbers(args.acceptance_rates, float, "--acceptance-rates")
    if any(b < 1 for b in batches) or any(not 0 < a < 1 for a in alphas):
        raise ConfigError("batch sizes must be >= 1 and acceptance rates in (0, 1)")
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                          max_model_len=args.max_model_len or 512, max_num_seqs=1, enforce_eager=args.enforce_eager,
                          speculative=dataclasses.replace(spec, adaptive=True))
    engine = Engine(config)
    target, draft = engine.runner.target_cost, engine.proposer.cost
    rows = predict(target, draft, spec.num_speculative_tokens, batches, alphas)
    result = {"model": args.model, "method": spec.method, "draft": spec.model, "k": spec.num_speculative_tokens,
              "context": CONTEXT, "target_cost": target.to_dict(), "draft_cost": draft.to_dict() if draft else None,
              "split": split(engine), "plan": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_table(result, batches, alphas))
    if args.plot:
        _plot(result, batches, alphas, Path(args.plot))
    return 0


def split(engine) -> dict:
    """Where the time goes on this machine (quickdraft/evaluation/measure.py): a one-row pass of the target
    and of the draft model (where the method has one) against its floor, and the engine's own
    time a decoding step. Run before the engine holds any sequence: the passes use slot 0."""
    from quickdraft.evaluation.measure import chain_split, engine_split, last_level_cache_bytes, measure_bandwidth, pass_split

    bandwidth = measure_bandwidth()["bandwidth_bytes_per_s"]
    out = {"target": pass_split(engine.decoder, engine.kv, bandwidth, context=CONTEXT),
           "last_level_cache_bytes": last_level_cache_bytes()}
    draft, draft_kv = getattr(engine.proposer, "model", None), getattr(engine.proposer, "kv", None)
    if draft is not None and draft_kv is not None:
        out["draft"] = pass_split(draft, draft_kv, bandwidth, context=CONTEXT)
        if getattr(engine.proposer, "native_chains", False):
            k = max(1, engine.config.speculative.num_speculative_tokens)
            out["draft_chain"] = chain_split(draft, draft_kv, out["draft"]["floor_ms"], k, context=CONTEXT)
    prompt = engine.tokenizer.encode(SPLIT_PROMPT)
    out["engine"] = engine_split(engine, prompt)
    # a sampled request's step too: its drafts carry q, and the verifier shapes the target's rows
    out["engine_sampled"] = engine_split(engine, prompt, temperature=SAMPLED_TEMPERATURE)
    return out


def _split_lines(split: dict) -> list[str]:
    def ms(v) -> str:
        return "-" if v is None else f"{v:.2f}"

    def share(v) -> str:
        return "-" if v is None else f"{v:.0%}"

    first = split["target"]
    lines = [f"a one-row pass, {first['context']} tokens of context, against its floor (weight bytes over "
             f"{first['bandwidth_gb_per_s']:.1f} GB/s read here), ms:",
             "model  | pass (floor, share)  | matrices (floor, share) | attention | rest of layers | outside layers "
             "| head (floor, share)"]
    for name in ("target", "draft"):
        p = split.get(name)
        if p is None:
            continue
        lines.append(
            f"{name:6} | {ms(p['total_ms'])} ({ms(p['floor_ms'])}, {share(p['floor_share'])}) | "
            f"{ms(p['matrices_ms'])} ({ms(p['layers_floor_ms'])}, {share(p['matrices_share'])}) | {ms(p['attention_ms'])} | "
            f"{ms(p['other_layer_ms'])} | {ms(p['outside_layers_ms'])} | "
            f"{ms(p['head_ms'])} ({ms(p['head_floor_ms'])}, {share(p['head_share'])})")
    c = split.get("draft_chain")
    if c is not None:
        lines.append(f"draft greedy chains of {c['k']} passes in one native call: {ms(c['pass_ms'])} ms a pass "
                     f"(floor {ms(c['floor_ms'])}, {share(c['floor_share'])})")
    cache = split.get("last_level_cache_bytes")
    for name in ("target", "draft"):
        p = split.get(name)
        weights = p and p["layer_weight_bytes"] + p["head_weight_bytes"]
        if cache and weights and weights < CACHE_HELD * cache:
            lines.append(f"note: the {name}'s weights ({weights / 2**20:.0f} MiB) are under {CACHE_HELD}x this CPU's last-level "
                         f"cache ({cache / 2**20:.0f} MiB): part of them can be read from it, not from memory, so its share "
                         "can pass 100%")
    for e in (split["engine"], split.get("engine_sampled")):
        if e is None:
            continue
        phases = ", ".join(f"{k} {v:.2f}" for k, v in e["phases_ms"].items())
        how = "greedy" if not e["temperature"] else f"sampled at temperature {e['temperature']:g}"
        lines.append(f"a decoding step (median of {e['steps']}, {how}): {ms(e['step_ms'])} ms = the models' passes "
                     f"{ms(e['models_ms'])} + the engine {ms(e['engine_ms'])} (phases: {phases})")
    return lines


def _table(result: dict, batches, alphas) -> str:
    from quickdraft.models.pass_cost import describe

    lines = [f"{name} pass: {describe(result[key])}" for name, key in (("target", "target_cost"), ("draft", "draft_cost"))
             if result[key]]
    lines += ["", *_split_lines(result["split"])]
    lines += ["", f"{result['method']}, K up to {result['k']}, {result['context']}-token contexts: "
              "planned K / expected speedup over plain decoding",
              "batch | " + " | ".join(f"alpha {a:.1f}" for a in alphas)]
    cell = {(r["batch"], r["acceptance"]): r for r in result["plan"]}
    for b in batches:
        lines.append(f"{b:5d} | " + " | ".join(
            f"K={cell[b, a]['k']} {cell[b, a]['speedup']:.2f}x".rjust(9) for a in alphas))
    return "\n".join(lines)


def _plot(result: dict, batches, alphas, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cell = {(r["batch"], r["acceptance"]): r for r in result["plan"]}
    grid = [[cell[b, a]["speedup"] for a in alphas] for b in batches]
    fig, ax = plt.subplots(figsize=(1.2 * len(alphas) + 2, 0.6 * len(batches) + 1.8))
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    ax.set_xticks(range(len(alphas)), [f"{a:.1f}" for a in alphas])
    ax.set_yticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("acceptance rate")
    ax.set_ylabel("running sequences")
    for i, b in enumerate(batches):
        for j, a in enumerate(alphas):
            r = cell[b, a]
            bright = im.norm(r["speedup"]) > 0.6  # the colour map is light at its top
            ax.text(j, i, f"K={r['k']}\n{r['speedup']:.2f}x", ha="center", va="center", fontsize=8,
                    color="black" if bright else "white")
    fig.colorbar(im, ax=ax, label="expected speedup")
    ax.set_title(f"{result['method']} on {result['model']}: the plan's K and expected speedup")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
