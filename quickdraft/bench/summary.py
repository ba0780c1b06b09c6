"""Runs -> the figures of each variant x dataset x category (see evaluation/stats.py for the terms).

Groups: every (dataset, category), every dataset over all its categories ("all"), and, with
several data sets, everything ("all", "all"). Speedups pair a variant's run with ``none``'s run of
the same request, seed and repeat.
"""

from __future__ import annotations

from quickdraft.evaluation import stats

ALL = "all"


def groups(requests: list[dict]) -> list[tuple[str, str, set[str]]]:
    """(dataset, category, request ids), in the order of first appearance."""
    out: dict[tuple[str, str], set[str]] = {}
    for r in requests:
        out.setdefault((r["dataset"], r["category"]), set()).add(r["id"])
    for r in requests:
        out.setdefault((r["dataset"], ALL), set()).add(r["id"])
    if len({r["dataset"] for r in requests}) > 1:
        out[(ALL, ALL)] = {r["id"] for r in requests}
    ordered = sorted(out.items(), key=lambda kv: (kv[0][0] == ALL, kv[0][0], kv[0][1] == ALL, kv[0][1]))
    return [(d, c, ids) for (d, c), ids in ordered]


def run_key(r: dict) -> tuple:
    return (r["request"], r.get("seed"), r.get("repeat", 0))


def summarize(result: dict) -> list[dict]:
    variants = [v["name"] for v in result["config"]["variants"]]
    methods = {v["name"]: v for v in result["config"]["variants"]}
    rows = []
    for dataset, category, ids in groups(result["requests"]):
        base = {run_key(r): r["tokens_per_second"] for r in result["runs"]
                if r["variant"] == "none" and r["request"] in ids}
        for name in variants:
            runs = [r for r in result["runs"] if r["variant"] == name and r["request"] in ids]
            if not runs:
                continue
            tps = [r["tokens_per_second"] for r in runs]
            row = {
                "variant": name, "method": methods[name]["method"], "k": methods[name]["k"],
                "dataset": dataset, "category": category, "n_requests": len({r["request"] for r in runs}),
                "n_runs": len(runs), "tokens_per_second_median": stats.median(tps),
                "tokens_per_second_p90": stats.percentile(tps, 90),
                "speedup": stats.speedup(base, {run_key(r): r["tokens_per_second"] for r in runs}),
                "ttft_median_s": stats.median([r["ttft_s"] for r in runs]),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
                "model_mib": result.get("model_mib", {}).get(name),
                **stats.pooled_acceptance(runs),
                "lossless": _lossless(result, name, ids, runs),
            }
            rows.append(row)
    return rows


def _lossless(result: dict, name: str, ids: set[str], runs: list[dict]) -> dict:
    if result["config"]["temperature"] == 0:
        divs = [d for d in result["divergences"] if d["variant"] == name and d["request"] in ids]
        same = [bool(r.get("identical_to_none")) for r in runs]
        return {
            "kind": "greedy", "n": len(same), "fraction_identical": sum(same) / len(same) if same else float("nan"),
            "num_divergences": len(divs), "min_margin": min((d["margin"] for d in divs), default=None),
            "all_rounding_level": all(d["rounding_level"] for d in divs),
        }
    tests = [stats.TVResult(**{k: v for k, v in t.items() if k not in ("request", "variant")})
             for t in result["tv_tests"] if t["variant"] == name and t["request"] in ids]
    return {"kind": "tv", **stats.combine_tv(tests)} if tests else {"kind": "tv", "n": 0}


def best(rows: list[dict], method: str | None = None, dataset: str | None = None) -> dict | None:
    """The fastest speculative variant (median speedup) of the top-level group."""
    top = [r for r in rows if r["category"] == ALL and r["dataset"] == (dataset or top_dataset(rows))
           and r["method"] != "none" and (method is None or r["method"] == method)]
    return max(top, key=lambda r: r["speedup"]["median"], default=None)


def top_dataset(rows: list[dict]) -> str:
    datasets = {r["dataset"] for r in rows}
    return ALL if ALL in datasets else next(iter(datasets), ALL)
