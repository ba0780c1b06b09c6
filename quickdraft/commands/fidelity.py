"""``quickdraft fidelity``: how far the path quickdraft runs is from the model it loads.

Speculation never changes what the target computes, but the target itself runs on quantized
blocks and bfloat16 activations by default. This command puts a number on that, as llama.cpp's
``llama-perplexity --kl-divergence`` does, and on the same text measures llama.cpp beside it:

- the *reference*: the same file dequantized, in float32, through the torch path (held to
  transformers' logits within 1e-4 by the tests of every family);
- *quickdraft*: the path ``generate`` and ``serve`` run with the given --dtype and --quantization;
- *llama.cpp*: the same GGUF file through llama-cpp-python, where it is installed (``pip install
  -e '.[peers]'``), on its own default path.

Then greedy decoding from a few short prompts, as a user sees the difference: where quickdraft's
tokens first differ from float32's and from llama.cpp's, and the top-2 logit margin there (of
quickdraft's path and of float32), which tells a near-tie from a real difference.

The text is cut into chunks of ``--ctx`` tokens, each beginning with the BOS token where the model
adds one, and only the second half of each chunk is scored, so that every scored token has at least
ctx/2 tokens of context (llama-perplexity's rule). For each path: the perplexity of the text, and
against the reference, per scored token, KL(reference || path) (mean, 99th percentile, maximum),
how often the two agree on the most likely token, and the largest difference in the
log-probability of the actual next token.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import torch

from quickdraft.errors import ConfigError, QuickdraftError


GREEDY_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
                  "The three laws of thermodynamics state that", "Here is a list of the planets of the solar system:")


def register(sub) -> None:
    from quickdraft.arguments import add_dtype_arg, add_model_positional, add_switch

    p = sub.add_parser("fidelity", help="KL divergence and perplexity of the default path (and llama.cpp's) "
                                        "against the float32 model")
    add_model_positional(p)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a built-in name (see `quickdraft models`), a .gguf file or a Hugging Face directory")
    add_dtype_arg(p)
    p.add_argument("--quantization", default="auto", choices=["auto", "gguf", "none"],
                   help="the path measured, as `quickdraft generate` takes it")
    p.add_argument("--text", help="a UTF-8 text file (default: the MT-Bench questions, one after the other)")
    p.add_argument("--ctx", type=int, default=512, help="tokens a chunk; the second half of each is scored")
    p.add_argument("--chunks", type=int, default=4, help="chunks scored at most")
    p.add_argument("--greedy-tokens", type=int, default=64, help="tokens decoded greedily from each short prompt")
    p.add_argument("--num-greedy-prompts", type=int, default=len(GREEDY_PROMPTS),
                   help=f"short prompts decoded greedily by each path (at most {len(GREEDY_PROMPTS)}; 0 skips it)")
    add_switch(p, "--llama-cpp", default=True, help="measure llama.cpp on the same GGUF file where llama-cpp-python "
                                                     "is installed")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: one per physical core)")
    add_switch(p, "--json", help="print one JSON object")
    p.set_defaults(func=fidelity)


def default_text() -> str:
    from quickdraft.evaluation.datasets import mtbench

    return "\n\n".join(turn for p in mtbench() for turn in p.turns)


def chunks(ids: list[int], ctx: int, limit: int, bos: int | None) -> list[list[int]]:
    """Whole chunks of ``ctx`` tokens, at most ``limit``, the first token of each made BOS (when the
    model has one), as llama-perplexity does."""
    out = [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)][:limit]
    return [[bos, *c[1:]] if bos is not None else c for c in out]


def scored_logprobs(logits: torch.Tensor, chunk: list[int]) -> torch.Tensor:
    """float32 log-probabilities [ctx/2 - 1, V] of the positions scored in one chunk: those
    predicting the tokens of its second half (position ctx/2 .. ctx-2 predicts the next one)."""
    first = len(chunk) // 2
    return torch.log_softmax(logits[first:len(chunk) - 1].float(), dim=-1)


class Tally:
    """Per-token figures of one path against the reference, over every chunk."""

    def __init__(self) -> None:
        self.nll: list[np.ndarray] = []
        self.kl: list[np.ndarray] = []
        self.same_top: list[np.ndarray] = []
        self.dlogp: list[np.ndarray] = []

    def add(self, ref: torch.Tensor, mine: torch.Tensor, targets: torch.Tensor) -> None:
        """ref, mine: log-probabilities [n, V] of the scored positions; targets [n]: the next tokens."""
        rows = torch.arange(len(targets))
        self.nll.append(-mine[rows, targets].double().numpy())
        self.kl.append((ref.exp() * (ref - mine)).sum(-1).clamp_min(0).double().numpy())
        self.same_top.append((ref.argmax(-1) == mine.argmax(-1)).numpy())
        self.dlogp.append((mine[rows, targets] - ref[rows, targets]).abs().double().numpy())

    def summary(self) -> dict:
        nll, kl = np.concatenate(self.nll), np.concatenate(self.kl)
        return {"tokens": int(nll.size), "perplexity": float(math.exp(nll.mean())),
                "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
                "same_top_token": float(np.concatenate(self.same_top).mean()),
                "max_abs_dlogp": float(np.concatenate(self.dlogp).max())}


def our_logits(decoder, chunk: list[int]) -> torch.Tensor:
    """Logits [len(chunk), V] of one chunk from position 0, through ``decoder`` (a Decoder)."""
    from quickdraft.models.decoder import AttentionMetadata
    from quickdraft.models.kv_cache import KVCache

    kv = KVCache(decoder.config, 1, len(chunk), decoder.dtype, device=decoder.device)
    meta = AttentionMetadata.chain([0], [0], [len(chunk)])
    with torch.inference_mode():
        hidden = decoder.forward(torch.tensor(chunk, device=decoder.device), meta.positions(decoder.device), kv, meta)
        return decoder.logits(hidden).float().cpu()


class LlamaCpp:
    """llama.cpp's logits of a chunk, through llama-cpp-python on the same GGUF file."""

    def __init__(self, path: str, ctx: int, threads: int | None, vocab: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=path, n_ctx=ctx, n_batch=ctx, logits_all=True, verbose=False,
                                   **({"n_threads": threads, "n_threads_batch": threads} if threads else {}))
        if self.llm.n_vocab() > vocab:
            raise QuickdraftError(f"llama.cpp reads {self.llm.n_vocab()} tokens from {path}, quickdraft {vocab}")
        self.vocab = vocab
        self.version = llama_cpp.__version__

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """llama.cpp's greedy continuation of ``ids``: the argmax of its logits, ``n`` times."""
        self.llm.reset()
        self.llm.eval(ids)
        out: list[int] = []
        for _ in range(n):
            out.append(int(np.argmax(self.llm.scores[self.llm.n_tokens - 1])))
            self.llm.eval(out[-1:])
        return out

    def logits(self, chunk: list[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(chunk)
        out = torch.full((len(chunk), self.vocab), float("-inf"))  # a padded embedding row is no token
        out[:, :self.llm.n_vocab()] = torch.from_numpy(np.asarray(self.llm.scores[:len(chunk)], dtype=np.float32))
        return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def greedy(reference, tested, decoders: dict, peer, dtype: str, prompts: tuple[str, ...], n: int) -> list[dict]:
    """Per prompt: where quickdraft's greedy tokens first differ from float32's and from llama.cpp's
    (None: nowhere in ``n`` tokens), with the top-2 margins of quickdraft's path and of float32 at
    that position; ``decoders``: {"quickdraft": the tested model's Decoder, "float32": the reference's}."""
    from quickdraft import LLM, SamplingParams
    from quickdraft.evaluation.measure import top2_margin

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ids = [reference.tokenizer.encode(p) for p in prompts]
    ours = [o.token_ids for o in LLM(tested, dtype=dtype).generate(ids, params)]
    f32 = [o.token_ids for o in LLM(reference, dtype="float32").generate(ids, params)]
    rows = []
    for prompt, prefix, mine, ref in zip(prompts, ids, ours, f32):
        row = {"prompt": prompt, "tokens": n}
        for name, other in (("float32", ref), ("llama.cpp", peer.greedy(prefix, n) if peer else None)):
            if other is None:
                continue
            at = first_difference(mine, other)
            row[name] = {"first_difference": at}
            if at is not None:
                with torch.inference_mode():
                    margins = {k: top2_margin(d, prefix + mine[:at]) for k, d in decoders.items()}
                row[name] |= {"quickdraft_token": mine[at], "their_token": other[at],
                              **{f"margin_{k}": m["margin"] for k, m in margins.items()}}
        rows.append(row)
    return rows


def _gguf_path(model: str) -> str | None:
    from quickdraft.models import registry

    if registry.is_builtin(model):
        return str(registry.model_path(model))
    return model if model.endswith(".gguf") else None


def measure(args) -> dict:
    from tqdm import tqdm

    from quickdraft.config import EngineConfig
    from quickdraft.models.decoder import Decoder
    from quickdraft.models.loader import load_model

    if args.ctx < 8 or args.ctx % 2:
        raise ConfigError(f"--ctx must be an even number of tokens, at least 8, got {args.ctx}", "ctx")
    if args.greedy_tokens < 1:
        raise ConfigError(f"--greedy-tokens must be at least 1, got {args.greedy_tokens}", "greedy_tokens")
    if args.chunks < 1:
        raise ConfigError(f"--chunks must be at least 1, got {args.chunks}", "chunks")
    started = time.perf_counter()
    if args.text:
        try:
            text = open(args.text, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--text {args.text!r} cannot be read as UTF-8 text: {e}", "text") from None
    else:
        text = default_text()
    dtype = EngineConfig(model=args.model, dtype=args.dtype).torch_dtype
    reference = load_model(args.model, torch.float32, quantization="none")
    tested = load_model(args.model, dtype, quantization=args.quantization)
    decoders = {"quickdraft": Decoder(tested.config, tested.weights), "float32": Decoder(reference.config, reference.weights)}
    tok = reference.tokenizer
    ids = tok.encode(text)
    bos = reference.config.bos_token_id if getattr(tok, "add_bos_token", False) else None
    parts = chunks(ids, args.ctx, args.chunks, bos)
    if not parts:
        raise ConfigError(f"the text has {len(ids)} tokens, fewer than one chunk of --ctx {args.ctx}", "text")
    path = _gguf_path(args.model)
    peer, peer_note = None, None
    if args.llama_cpp and path is None:
        peer_note = "not a GGUF file"
    elif args.llama_cpp:
        try:
            peer = LlamaCpp(path, args.ctx, args.threads, reference.config.vocab_size)
        except ImportError:
            peer_note = "llama-cpp-python is not installed (pip install -e '.[peers]')"
    tallies = {"quickdraft": Tally(), **({"llama.cpp": Tally()} if peer else {})}
    ref_nll = []
    for chunk in tqdm(parts, desc="scoring chunks", unit="chunk", disable=args.json):
        ref = scored_logprobs(our_logits(decoders["float32"], chunk), chunk)
        targets = torch.tensor(chunk[len(chunk) // 2 + 1:])
        ref_nll.append(-ref[torch.arange(len(targets)), targets].double().numpy())
        tallies["quickdraft"].add(ref, scored_logprobs(our_logits(decoders["quickdraft"], chunk), chunk), targets)
        if peer:
            tallies["llama.cpp"].add(ref, scored_logprobs(peer.logits(chunk), chunk), targets)
    name = str(dtype).removeprefix("torch.")
    prompts = GREEDY_PROMPTS[:max(0, args.num_greedy_prompts)]
    rows = greedy(reference, tested, decoders, peer, name, prompts, args.greedy_tokens) if prompts else []
    return {"model": args.model, "dtype": name, "quantization": args.quantization,
            "ctx": args.ctx, "chunks": len(parts), "text_tokens": len(ids),
            "reference": {"tokens": int(sum(n.size for n in ref_nll)),
                          "perplexity": float(math.exp(np.concatenate(ref_nll).mean()))},
            "paths": {name: t.summary() for name, t in tallies.items()},
            "llama_cpp": {"version": peer.version} if peer else {"skipped": peer_note or "--no-llama-cpp"},
            "greedy": rows,
            "seconds": time.perf_counter() - started}


def table(r: dict) -> str:
    lines = [f"quickdraft fidelity: {r['model']}, {r['chunks']} chunks of {r['ctx']} tokens "
             f"({r['reference']['tokens']} scored), against float32 dequantized (perplexity "
             f"{r['reference']['perplexity']:.4f})", "",
             f"  {'path':40} {'perplexity':>10} {'KL mean':>9} {'KL p99':>9} {'KL max':>9} {'same top':>8} {'max|dlogp|':>10}"]
    names = {"quickdraft": f"quickdraft {r['dtype']}, quantization {r['quantization']}",
             "llama.cpp": f"llama.cpp {r['llama_cpp'].get('version', '')}"}
    for name, s in r["paths"].items():
        lines.append(f"  {names[name]:40} {s['perplexity']:10.4f} {s['kl_mean']:9.5f} {s['kl_p99']:9.5f} "
                     f"{s['kl_max']:9.5f} {100 * s['same_top_token']:7.2f}% {s['max_abs_dlogp']:10.4f}")
    if "skipped" in r["llama_cpp"]:
        lines.append(f"  llama.cpp: skipped ({r['llama_cpp']['skipped']})")
    lines.append("\nKL in nats a token, KL(float32 || path)")
    if r["greedy"]:
        lines += ["", f"greedy, {r['greedy'][0]['tokens']} tokens: where quickdraft's first differ, and the top-2 margin "
                      "there (quickdraft's path / float32)"]
        for row in r["greedy"]:
            cells = []
            for name in ("float32", "llama.cpp"):
                d = row.get(name)
                if d is None:
                    continue
                cells.append(f"{name}: identical" if d["first_difference"] is None else
                             f"{name}: at {d['first_difference']}, margin {d['margin_quickdraft']:.3f} / {d['margin_float32']:.3f}")
            lines.append(f"  {row['prompt'][:28]:28}  " + "; ".join(cells))
    lines.append(f"\n{r['seconds']:.0f}s")
    return "\n".join(lines)


def fidelity(args) -> int:
    r = measure(args)
    print(json.dumps(r) if args.json else table(r))
    return 0
