"""A finished run -> the terminal table, ``results.json``, ``report.md`` and PNG plots.

Plots use matplotlib's object API (``Figure``, the Agg canvas), never pyplot's global state.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from quickdraft.bench.peers import llama_cpp_best
from quickdraft.bench.summary import ALL, best, top_dataset
from quickdraft.evaluation.report_format import clean, figure, md_table, text_table

PLOTS = {
    "speedup": "speedup_by_category.png",
    "acceptance": "acceptance_by_position.png",
    "k": "tokens_per_second_vs_k.png",
    "peers": "quickdraft_vs_peers.png",
}


# -- cells ----------------------------------------------------------------------------------------

def _f(x, digits: int = 2, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}{suffix}"


def _pct(x) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{100 * x:.0f}%"


def lossless_cell(l: dict) -> str:
    if l.get("kind") == "greedy":
        if l["num_divergences"] == 0:
            return f"{_pct(l['fraction_identical'])} identical"
        why = "rounding-level" if l["all_rounding_level"] else "NOT rounding-level"
        return (f"{_pct(l['fraction_identical'])} identical; {l['num_divergences']} diverged, "
                f"min margin {_f(l['min_margin'], 3)} ({why})")
    if not l.get("n"):
        return "-"
    return f"TV {_f(l['tv'], 3)} vs null {_f(l['tv_null'], 3)} ± {_f(l['tv_se'], 3)}, p={_f(l['p_value'], 2)}"


def _positions(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values) if values else "-"


# -- tables -------------------------------------------------------------------------------------

MAIN_HEADERS = ["variant", "dataset", "category", "n", "tok/s med", "tok/s p90", "speedup", "geomean",
                "acc. len", "acc. rate", "rows/pass", "TTFT s", "RSS MiB", "own MiB", "lossless"]


def main_rows(rows: list[dict], categories: bool) -> list[list[str]]:
    out = []
    for r in rows:
        if (r["category"] != ALL) != categories:
            continue
        out.append([r["variant"], r["dataset"], r["category"], str(r["n_requests"]),
                    _f(r["tokens_per_second_median"]), _f(r["tokens_per_second_p90"]),
                    _f(r["speedup"]["median"], 2, "x"), _f(r["speedup"]["geomean"], 2, "x"),
                    _f(r["mean_accepted_length"]), _pct(r["acceptance_rate"]) if r["method"] != "none" else "-",
                    _f(1 + r["num_draft_tokens"] / r["num_target_passes"]) if r["num_target_passes"] else "-",
                    _f(r["ttft_median_s"], 3), _f(r["peak_rss_mib"], 0), _f(r["model_mib"], 0),
                    lossless_cell(r["lossless"])])
    return out


PEER_HEADERS = ["peer", "dataset", "n", "tok/s med", "TTFT s", "speedup/own plain", "draft acc.", "quickdraft twin",
                "qd tok/s", "quickdraft/peer", "same as qd none", "same prefix"]


def _peer_row(r: dict, name: str | None = None) -> list[str]:
    return [name or r["name"], r["dataset"], str(r["n"]), _f(r["tokens_per_second_median"]), _f(r["ttft_median_s"], 3),
            _f(r["speedup_over_own_plain"], 2, "x"), _pct(r.get("draft_acceptance_rate")),
            r["quickdraft_variant"] or "-", _f(r["quickdraft_tokens_per_second_median"]),
            _f(r["quickdraft_over_peer"], 2, "x"), _pct(r["fraction_identical_to_quickdraft_none"]),
            _f(r.get("identical_prefix_median"), 0)]


def peer_rows(peers: dict | None) -> list[list[str]]:
    """Every peer method, then per data set "llama.cpp plain" and "llama.cpp best" (the fastest
    plain and the fastest of all llama.cpp's methods) side by side."""
    if not peers:
        return []
    rows = [_peer_row(r) for r in peers["summary"]]
    for b in llama_cpp_best(peers["summary"]):
        if b["plain"]:
            rows.append(_peer_row(b["plain"], f"llama.cpp plain = {b['plain']['name']}"))
        rows.append(_peer_row(b["best"], f"llama.cpp best = {b['best']['name']}"))
    return rows


LLAMA_HEADERS = ["dataset", "llama.cpp plain", "tok/s", "llama.cpp best", "tok/s", "best/plain", "quickdraft best",
                 "tok/s", "quickdraft best / llama.cpp plain", "quickdraft best / llama.cpp best"]


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def llama_rows(result: dict) -> list[list[str]]:
    """Per data set: llama.cpp plain, llama.cpp best, and quickdraft's best variant beside them."""
    out = []
    for b in llama_cpp_best((result.get("peers") or {}).get("summary") or []):
        plain, top = b["plain"] or {}, b["best"]
        ours = best(result["summary"], dataset=b["dataset"])
        qd = ours["tokens_per_second_median"] if ours else None
        out.append([b["dataset"], plain.get("name", "-"), _f(plain.get("tokens_per_second_median")), top["name"],
                    _f(top["tokens_per_second_median"]), _f(b["best_over_plain"], 2, "x"),
                    ours["variant"] if ours else "-", _f(qd),
                    _f(_ratio(qd, plain.get("tokens_per_second_median")), 2, "x"),
                    _f(_ratio(qd, top["tokens_per_second_median"]), 2, "x")])
    return out


def invariance_line(inv: dict | None) -> str:
    """Whether this run's greedy outputs are promised equal bit for bit (docs/design/batch-invariance.md: what it covers)."""
    if inv is None:
        return "batch invariance: not recorded"
    verdict = "promised" if inv["promised"] else "NOT promised"
    return f"batch invariance: {verdict} on this machine ({inv['path']}): {inv['why']}"


def floor_line(fl: dict) -> str:
    """The floor in words; a run that probed the bandwidth beside each plain run says its range and
    that each run was held to the floor of its own moment (bench/floor.py)."""
    low_high = fl.get("bandwidth_gb_per_s_range")
    spread = (f", median of {fl['probes']} probes beside the plain runs, {low_high[0]:.1f}-{low_high[1]:.1f} GB/s"
              if low_high and fl.get("probes", 0) > 1 else "")
    return (f"floor: {fl['bandwidth_gb_per_s']:.1f} GB/s read bandwidth ({fl['threads']} threads{spread}) / "
            f"{fl['weight_bytes_per_token'] / 2**20:.0f} MiB of weights per token = "
            f"{fl['floor_tokens_per_second']:.2f} tok/s; none decodes at {_f(fl['none_tokens_per_second'])} tok/s, "
            f"{_pct(fl['fraction_of_floor'])} of the floor" + (" beside it (median)" if spread else ""))


PEER_STATUS_HEADERS = ["peer", "status", "requests done", "version", "build"]
BUILD_FEATURES = ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8")


def _build(system: dict) -> str:
    """The CPU features a peer's build uses (llama.cpp's system info), or its torch version."""
    features = system.get("features") or {}
    if features:
        return " ".join(f"{k}={features[k]}" for k in BUILD_FEATURES if k in features) or "-"
    return f"torch {system['torch']}" if system.get("torch") else "-"


def peer_status_rows(peers: dict | None) -> list[list[str]]:
    """Each peer asked for: how its child process ended and what build ran."""
    if not peers:
        return []
    rows = []
    for s in peers.get("status") or []:
        state = s["status"] + (f" (signal {s['signal']})" if s.get("signal") else "")
        system = s.get("system") or {}
        rows.append([s["peer"], state, f"{s['requests_finished']}/{s['requests_total']}",
                     str(system.get("version") or "-"), _build(system)])
    return rows


def headline(result: dict) -> list[str]:
    rows = result["summary"]
    lines = []
    b = best(rows)
    if b:
        lines.append(f"best: {b['variant']} on {top_dataset(rows)}: {_f(b['speedup']['median'], 2, 'x')} median "
                     f"speedup, {_f(b['tokens_per_second_median'])} tok/s, "
                     f"{_f(b['mean_accepted_length'])} tokens per target pass")
    peers = (result.get("peers") or {}).get("summary") or []
    top = [p for p in peers if p["dataset"] == top_dataset(rows)]
    if top and b:
        fastest = max(top, key=lambda p: p["tokens_per_second_median"] or 0)
        ratio = (b["tokens_per_second_median"] or 0) / fastest["tokens_per_second_median"] \
            if fastest["tokens_per_second_median"] else float("nan")
        lines.append(f"best peer: {fastest['name']} at {_f(fastest['tokens_per_second_median'])} tok/s; "
                     f"quickdraft's best / it = {_f(ratio, 2, 'x')}")
    llama = next((x for x in llama_cpp_best(peers) if x["dataset"] == top_dataset(rows)), None)
    if llama and b:
        plain, top = llama["plain"] or {}, llama["best"]
        lines.append(f"llama.cpp plain: {_f(plain.get('tokens_per_second_median'))} tok/s ({plain.get('name', '-')}); "
                     f"llama.cpp best: {_f(top['tokens_per_second_median'])} tok/s ({top['name']}, "
                     f"{_f(llama['best_over_plain'], 2, 'x')} its plain); quickdraft's best / llama.cpp best = "
                     f"{_f(_ratio(b['tokens_per_second_median'], top['tokens_per_second_median']), 2, 'x')}")
    return lines


def terminal(result: dict) -> str:
    parts = [text_table(MAIN_HEADERS, main_rows(result["summary"], categories=False))]
    pr = peer_rows(result.get("peers"))
    if pr:
        parts.append(text_table(PEER_HEADERS, pr))
    lr = llama_rows(result)
    if lr:
        parts.append(text_table(LLAMA_HEADERS, lr))
    ps = peer_status_rows(result.get("peers"))
    if any(row[1] != "ok" for row in ps):
        parts.append(text_table(PEER_STATUS_HEADERS, ps))
    parts.append(floor_line(result["floor"]))
    parts.append(invariance_line(result.get("batch_invariance")))
    parts += headline(result)
    parts += [f"note: {n}" for n in result["notes"]]
    return "\n\n".join(parts)


def markdown(result: dict, plots: dict[str, str]) -> str:
    c, m = result["config"], result["machine"]
    rows = result["summary"]
    out = [
        "# quickdraft bench", "",
        f"`{result['command']}`", "",
        f"- target: {result['models']['target']['name']} ({c['dtype']}), draft: "
        f"{(result['models'].get('draft') or {}).get('name', '-')}",
        f"- {len(result['requests'])} requests from {', '.join(c['datasets'])}; max {c['max_tokens']} tokens, "
        f"temperature {c['temperature']}" + (f", {c['num_seeds']} seeds" if c["temperature"] else ""),
        f"- machine: {m['cpu']}, {m['cpu_count']} cores, {m['torch_threads']} torch threads, "
        f"{_f(m.get('memory_gib'), 0)} GiB; torch {result['versions']['torch']}",
        f"- started {result['started_at']}, took {result['duration_s'] / 60:.1f} min", "",
        *[x for line in headline(result) for x in (f"**{line}**", "")],
        "## Summary", "", md_table(MAIN_HEADERS, main_rows(rows, categories=False)), "",
        "Speedup: median over requests of the variant's tokens/s over `none`'s on the same request, run back to "
        "back. acc. len: tokens per target pass (bonus token included). rows/pass: rows each target pass verified for a request, its drafts (a tree's nodes) and one (prompt passes included). RSS: the process's peak resident "
        "memory while the variant ran (every engine of the run is loaded); own: the weights and KV caches that "
        "variant needs alone. Lossless: greedy runs compared with "
        "`none` token for token (at a divergence, the target's top-2 logit margin), or the per-position TV "
        "distance against its sampling null.", "",
        "## By category", "", md_table(MAIN_HEADERS, main_rows(rows, categories=True)), "",
        "## Acceptance by position", "",
        md_table(["variant", "dataset", "acceptance at draft position 1, 2, ..."],
                 [[r["variant"], r["dataset"], _positions(r["acceptance_by_position"])] for r in rows
                  if r["category"] == ALL and r["method"] != "none"]), "",
        "## The floor", "", floor_line(result["floor"]), "",
        "## Bit for bit", "", invariance_line(result.get("batch_invariance")), "",
    ]
    if result["divergences"]:
        out += ["## Greedy divergences", "", md_table(
            ["request", "variant", "position", "none token", "variant token", "top-2 margin", "rounding-level"],
            [[d["request"], d["variant"], str(d["position"]), str(d["none_token"]), str(d["variant_token"]),
              _f(d["margin"], 4), "yes" if d["rounding_level"] else "NO"] for d in result["divergences"]]), ""]
    pr, ps = peer_rows(result.get("peers")), peer_status_rows(result.get("peers"))
    if pr or ps:
        out += ["## Peers", ""]
        if pr:
            out += [md_table(PEER_HEADERS, pr), "",
                    "draft acc.: the peer's drafted tokens accepted, where it counts them (llama-server). same as qd "
                    "none: the requests whose output equals quickdraft's plain decoding token for token; same "
                    "prefix: the tokens each output shares with it from the start (median).", ""]
        lr = llama_rows(result)
        if lr:
            out += ["### llama.cpp plain and at its best", "",
                    "llama.cpp plain: the fastest plain decoding of the llama.cpp peers (llama-cpp-python, "
                    "llama-server); llama.cpp best: the fastest of all their methods (prompt lookup, llama-server's "
                    "draft model and n-gram modes), per data set; quickdraft best: the variant of the fastest "
                    "median speedup.", "", md_table(LLAMA_HEADERS, lr), ""]
        if ps:
            out += ["Each peer runs in its own process under a time limit; one that crashes, hangs or is "
                    "missing is noted below and the rest of the run is kept.", "",
                    md_table(PEER_STATUS_HEADERS, ps), ""]
            out += [f"- {s['peer']} system info: `{s['system']['system_info']}`"
                     for s in result["peers"]["status"] if (s.get("system") or {}).get("system_info")]
            out += [f"- {s['peer']} {method}: `{' '.join(cmd)}`" for s in result["peers"]["status"]
                    for method, cmd in ((s.get("system") or {}).get("commands") or {}).items()]
            out.append("")
    if plots:
        out += ["## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()] + [""]
    if result["notes"]:
        out += ["## Notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(out)


# -- plots --------------------------------------------------------------------------------------

def plot_speedup(rows: list[dict], path: Path) -> bool:
    spec = [r for r in rows if r["method"] != "none"]
    if not spec:
        return False
    groups = list(dict.fromkeys(f"{r['dataset']}/{r['category']}" for r in spec))
    variants = list(dict.fromkeys(r["variant"] for r in spec))
    fig, ax = figure(max(8.0, 0.35 * len(groups) * max(1, len(variants)) ** 0.5 + 4), 5.0)
    width = 0.8 / len(variants)
    for j, v in enumerate(variants):
        ys = {f"{r['dataset']}/{r['category']}": r["speedup"]["median"] for r in spec if r["variant"] == v}
        ax.bar([i + j * width for i in range(len(groups))], [ys.get(g) or 0 for g in groups], width, label=v)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("median speedup over none")
    ax.set_title("Speedup by category and method")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    return True


def plot_acceptance(rows: list[dict], path: Path) -> bool:
    top = [r for r in rows
           if r["category"] == ALL and r["dataset"] == top_dataset(rows) and r["acceptance_by_position"]]
    if not top:
        return False
    fig, ax = figure()
    for r in top:
        xs = list(range(1, len(r["acceptance_by_position"]) + 1))
        ax.plot(xs, r["acceptance_by_position"], marker="o", label=r["variant"])
    ax.set_xticks(range(1, max(len(r["acceptance_by_position"]) for r in top) + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Acceptance by position ({top_dataset(rows)})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return True


def plot_k(rows: list[dict], floor_tps: float | None, path: Path) -> bool:
    top = [r for r in rows if r["category"] == ALL and r["dataset"] == top_dataset(rows)]
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in top:
        if r["method"] != "none":
            label = " ".join(p for p in r["variant"].split() if not p.startswith("K="))
            lines.setdefault(label, []).append((r["k"], r["tokens_per_second_median"] or 0))
    if not lines:
        return False
    fig, ax = figure()
    for label, pts in lines.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    none = next((r for r in top if r["method"] == "none"), None)
    if none:
        ax.axhline(none["tokens_per_second_median"], color="gray", linestyle="--", label="none")
    if floor_tps:
        ax.axhline(floor_tps, color="red", linestyle=":", label="floor (plain, bandwidth-bound)")
    ax.set_xticks(sorted({k for pts in lines.values() for k, _ in pts}))
    ax.set_xlabel("K (num_speculative_tokens)")
    ax.set_ylabel("median tokens/s")
    ax.set_title(f"Tokens/s against K ({top_dataset(rows)})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return True


def plot_peers(result: dict, path: Path) -> bool:
    summary = (result.get("peers") or {}).get("summary") or []
    peers = [p for p in summary if p["dataset"] == top_dataset(result["summary"])]
    if not peers:
        return False
    labels, ours, theirs = [], [], []
    for p in peers:
        labels.append(f"{p['name']}\nvs {p['quickdraft_variant']}")
        theirs.append(p["tokens_per_second_median"] or 0)
        ours.append(p["quickdraft_tokens_per_second_median"] or 0)
    fig, ax = figure(max(8.0, 1.6 * len(labels)), 4.5)
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], theirs, 0.4, label="peer")
    ax.bar([x + 0.2 for x in xs], ours, 0.4, label="quickdraft")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("median tokens/s")
    ax.set_title("quickdraft against the peers (same prompts, greedy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return True


def plots(result: dict, out: Path) -> dict[str, str]:
    made = {}
    rows = result["summary"]
    if plot_speedup(rows, out / PLOTS["speedup"]):
        made["speedup"] = PLOTS["speedup"]
    if plot_acceptance(rows, out / PLOTS["acceptance"]):
        made["acceptance"] = PLOTS["acceptance"]
    if plot_k(rows, result["floor"].get("floor_tokens_per_second"), out / PLOTS["k"]):
        made["k"] = PLOTS["k"]
    if plot_peers(result, out / PLOTS["peers"]):
        made["peers"] = PLOTS["peers"]
    return made


# -- files --------------------------------------------------------------------------------------

def write(result: dict, out: Path) -> dict[str, Path]:
    """results.json, report.md and the plots into ``out``; returns what was written."""
    from quickdraft.bench.schema import validate

    out.mkdir(parents=True, exist_ok=True)
    made = plots(result, out)
    missing = sorted(set(PLOTS) - set(made))
    if missing:
        result["notes"].append(f"plots not drawn (nothing to show): {', '.join(PLOTS[k] for k in missing)}")
    data = clean(result)
    validate(data)
    (out / "results.json").write_text(json.dumps(data, indent=1, allow_nan=False))
    (out / "report.md").write_text(markdown(data, made))
    return {"results": out / "results.json", "report": out / "report.md", **{k: out / v for k, v in made.items()}}
