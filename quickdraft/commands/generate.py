"""``quickdraft generate [MODEL] PROMPT``: one prompt, its text and the speculative figures."""

from __future__ import annotations

import json
import sys

from quickdraft.arguments import add_model_args, add_sampling_args, add_switch, resolve_model_args
from quickdraft.errors import ConfigError


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("words", nargs="+", metavar="[MODEL] PROMPT",
                   help="the prompt, after the model where it comes first (else --model)")
    add_model_args(g, positional=False)  # [MODEL] PROMPT: the words
    add_sampling_args(g)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    add_switch(g, "--chat", help="apply the model's chat template to the prompt")
    add_switch(g, "--json", help="print one JSON object")
    g.set_defaults(func=generate)


def generate(args) -> int:
    from quickdraft import LLM, SamplingParams
    from quickdraft.evaluation.measure import summarize

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    if len(args.words) > 2:
        raise ConfigError(f"generate takes [MODEL] PROMPT, got {len(args.words)} words: quote the prompt", "prompt")
    *model, prompt = args.words
    if model:
        args.model_positional = model[0]
        resolve_model_args(args)
    llm = LLM(args.model, speculative_config=args.speculative_config, dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=1, quantization=args.quantization,
              enforce_eager=args.enforce_eager)
    if args.max_model_len is None:  # a length chosen here is said, with why; a length given needs no word
        print(f"quickdraft: {llm.max_model_len_reason}", file=sys.stderr)
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    with llm:
        out = llm.generate([llm.tokenizer.encode(prompt)], params)[0]
    report = summarize(out, llm.engine.config.speculative)
    if args.json:
        print(json.dumps(report))
    else:
        print(out.text)
        s = report["spec"]
        print(
            f"\n[{report['num_generated_tokens']} tokens in {report['seconds']:.2f}s, "
            f"{report['tokens_per_second']:.2f} tok/s | {s['method']} K={s['num_speculative_tokens']}: "
            f"{s['num_target_passes']} target passes, accepted {s['num_accepted_tokens']}/{s['num_draft_tokens']} "
            f"({s['acceptance_rate']:.0%}), {s['mean_accepted_length']:.2f} tokens/pass]",
            file=sys.stderr,
        )
    return 0
