"""The report of ``quickdraft advise`` (advise.py): markdown with its tables and plots, and the JSON
of every figure. Its tables and plots are drawn by evaluation/report_format.py, as the bench's are, so the two
reports look alike."""

from __future__ import annotations

import json
from pathlib import Path

from quickdraft.evaluation.report_format import clean, figure, md_table

MIB = 2**20


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def _s(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def plot_acceptance(result: dict, path: Path) -> bool:
    fig, ax = figure(7.0, 4.0)
    drawn = False
    for d in result["drafters"]:
        by_pos = d["runs"][0]["accepted_per_position"]
        if by_pos:
            ax.plot(range(1, len(by_pos) + 1), by_pos, marker="o", label=d["name"])
            drawn = True
    if not drawn:
        return False
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (batch 1)")
    ax.set_ylim(0, 1.02)
    ax.legend()
    ax.set_title("Acceptance by position on your prompts")
    fig.tight_layout()
    fig.savefig(path)
    return True


def plot_speedup(result: dict, path: Path) -> bool:
    if not result["drafters"]:
        return False
    fig, ax = figure(7.0, 4.0)
    for d in result["drafters"]:
        xs = sorted(int(b) for b in d["speedup"])
        ax.plot(xs, [d["speedup"][str(b)] for b in xs], marker="o", label=d["name"])
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("requests in a batch")
    ax.set_ylabel("speedup over plain decoding (tokens/s)")
    ax.set_xticks(sorted({int(b) for d in result["drafters"] for b in d["speedup"]}))
    ax.legend()
    ax.set_title("Speedup by batch size")
    fig.tight_layout()
    fig.savefig(path)
    return True


def markdown(result: dict, plots: dict[str, str]) -> str:
    v, base = result["verdict"], result["baseline"]
    lines = [f"# quickdraft advise: {result['model']} on {result['prompts_source']}", "",
             f"{result['num_prompts']} prompts, up to {result['max_tokens']} tokens each, greedy, {result['dtype']}, "
             f"on {result['machine']}; {result['duration_s'] / 60:.1f} min. Command: `{result['command']}`", "",
             "## Verdict", "", f"**{v['text']}**", ""]
    if v["speculative_config"]:
        lines += ["```", f"--speculative-config '{json.dumps(v['speculative_config'])}'", "```", ""]
    if v["reasons"]:
        lines += ["Inputs to the decision:", ""] + [f"- {r}" for r in v["reasons"]] + [""]
    lines += ["## Baseline (plain decoding)", ""]
    rows = [[str(r["batch"]), str(r["requests"]), f"{r['tokens_per_second']:.1f}", _s(r["ttft_p50_s"]),
             _s(r["tpot_p50_s"])] for r in base["runs"]]
    lines += [md_table(["batch", "requests", "tokens/s", "TTFT p50 (s)", "TPOT p50 (s)"], rows), ""]
    mem = base["memory"]
    lines += [f"Median answer: {base['answer_tokens_p50']:.0f} tokens. Memory at batch " + ", ".join(
        f"{b}: {_mib(m['target_weights'])} MiB weights + {_mib(m['target_kv'])} MiB KV" for b, m in mem.items())
        + f" ({result['context_tokens']}-token contexts); measured peak RSS {base['peak_rss_mib']:.0f} MiB.", ""]
    lines += ["## Drafters at the planner's K", "",
              f"K up to {result['k']}, chosen each step by the engine's adaptive planner (quickdraft/engine/plan.py); "
              "*drafted*: tokens a draft held on average (the planner's K, or fewer where the drafter found "
              "fewer); acceptance and tokens per target pass at batch 1; speedup is tokens/s over plain decoding "
              "at the same batch size, prompt passes included.", ""]
    head = ["drafter", "drafted", "acceptance", "tokens/pass", "acceptance by position"] + [
        f"speedup @{b}" for b in result["batch_sizes"]] + ["adds (MiB)"]
    rows = []
    for d in result["drafters"]:
        r1 = d["runs"][0]
        rows.append([d["name"], f"{r1['mean_draft_length']:.1f}", f"{r1['acceptance_rate']:.0%}", f"{r1['mean_accepted_length']:.2f}",
                     " ".join(f"{a:.2f}" for a in r1["accepted_per_position"]) or "-"]
                    + [f"{d['speedup'][str(b)]:.2f}x" for b in result["batch_sizes"]]
                    + [_mib(max(m["added"] for m in d["memory"].values()))])
    lines += [md_table(head, rows), ""]
    lines += ["Memory each drafter adds, at the largest batch (MiB): draft weights / draft KV / scratch of a "
              "verification pass (estimated from shapes) / proposer state (suffix: the trie's bound).", ""]
    b = str(max(result["batch_sizes"]))
    rows = [[d["name"], _mib(d["memory"][b]["draft_weights"]), _mib(d["memory"][b]["draft_kv"]),
             _mib(d["memory"][b]["verify_scratch"]), _mib(d["memory"][b]["proposer_state"]),
             f"{d['peak_rss_mib']:.0f}"] for d in result["drafters"]]
    lines += [md_table(["drafter", "weights", "KV", "verify scratch", "proposer state", "peak RSS"], rows), ""]
    if result["headroom"]:
        lines += [f"Headroom: a verification pass of K + 1 = {result['k'] + 1} rows costs {result['headroom']:.2f}x a "
                  "plain decoding step at batch 1 (the engine's calibrated cost model; `quickdraft profile` shows "
                  "it by batch size and acceptance).", ""]
    for title, name in (("Acceptance by position", "acceptance"), ("Speedup by batch size", "speedup")):
        if name in plots:
            lines += [f"![{title}]({plots[name]})", ""]
    lines += ["Trained heads (EAGLE-3, Medusa) are not among the candidates here: train one with "
              f"`quickdraft train eagle3 --model {result.get('model', 'MODEL')}` and measure it beside these with "
              "`quickdraft bench --methods none,eagle3,medusa`.", ""]
    return "\n".join(lines)


def write(result: dict, out: Path) -> Path:
    """report.md, its plots (advise_*.png) and results.json under ``out``; the markdown's path."""
    out.mkdir(parents=True, exist_ok=True)
    plots = {}
    for name, draw in (("acceptance", plot_acceptance), ("speedup", plot_speedup)):
        path = out / f"advise_{name}.png"
        if draw(result, path):
            plots[name] = path.name
    (out / "results.json").write_text(json.dumps(clean(result), indent=2))
    report = out / "report.md"
    report.write_text(markdown(result, plots))
    return report
