"""The engine: requests in, one speculative step at a time, outputs out.

``step`` reads like the data path in docs/design/architecture.md: schedule, run (engine/runner.py: propose,
build the verification pass, forward, verify, commit), postprocess. Each request
has its own sampling parameters, its own generator (seeded by its seed), its own K and its own
stop conditions; the batch around it changes nothing in its tokens (see models/decoder/ on batch
invariance).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import time
from pathlib import Path

from quickdraft.config import EngineConfig
from quickdraft.engine.detokenizer import IncrementalDetokenizer
from quickdraft.engine.plan import TRUSTED_PASSES, Acceptance, SpeculationSwitch, plan_draft_lengths
from quickdraft.engine.prefix_cache import PrefixCache
from quickdraft.engine.runner import Runner, StepResult
from quickdraft.engine.scheduler import Scheduler
from quickdraft.engine.sequence import RequestOutput, Sequence, SpecStats
from quickdraft.engine.stops import StopRules
from quickdraft.engine.threads import governor
from quickdraft.errors import ConfigError, PromptTooLongError
from quickdraft.models.decoder import Decoder
from quickdraft.models.ggml import on_blocks
from quickdraft.models.kv_cache import KVCache, fit_max_model_len, free_memory
from quickdraft.models.loader import LoadedModel, load_model
from quickdraft.models.pass_cost import calibrate, key_reads, write_json
from quickdraft.models.registry import cache_dir
from quickdraft.proposers.base import ProposerContext, create_proposer
from quickdraft.sampling import SamplingParams, make_generator
from quickdraft.structured import GrammarCompiler

log = logging.getLogger("quickdraft.engine")

PROBE_ACCEPTANCE = 0.8  # the acceptance rate a probe is planned with (adaptive K)
# A drafter's acceptance from earlier processes (the same target, drafter and settings on this
# machine's cache) starts a new process's estimate, weighing as this many steps at most (0: none
# kept, none read).
HISTORY_STEPS = 8
HISTORY_EVERY = 30.0  # seconds between two writes of it while requests keep running
PROBE_CATCHUP = 16  # the most tokens a draft may have to read first for a sequence a probe forces
MAX_FORCED_DRAFT = 16  # a grammar's forced tokens proposed in one step (structured.py)


class Engine:
    def __init__(self, config: EngineConfig, target: LoadedModel | None = None):
        self.config = config
        dtype = config.torch_dtype
        quantization = config.quantization
        if target is not None and quantization == "auto":  # a draft loaded here follows the given target
            quantization = "gguf" if on_blocks(target.weights) else None
        load = functools.partial(load_model, dtype=dtype, device=config.device, quantization=quantization)
        self.model = target if target is not None else load(config.model)
        self.tokenizer = self.model.tokenizer
        self.decoder = Decoder(self.model.config, self.model.weights, cuda_graphs=not config.enforce_eager)
        # the length a sequence may hold, and one line saying why (models/kv_cache.py): the one given
        # where the model's context and the memory left after the weights hold it, else an error;
        # by default the model's context, less where the KV cache would not fit
        self.max_model_len, self.max_model_len_reason = fit_max_model_len(
            self.model.config, config.max_model_len, config.max_num_seqs, dtype, config.device,
            free_memory(config.device))
        self.kv = KVCache(self.model.config, config.max_num_seqs, self.max_model_len, dtype, config.device)
        ctx = ProposerContext(
            target=self.model, dtype=dtype, device=config.device, num_slots=config.max_num_seqs,
            max_model_len=self.max_model_len,
            load_model=lambda m, device=config.device, **kw: m if isinstance(m, LoadedModel) else load(m, device=device, **kw),
            decoder=self.decoder, kv=self.kv, cuda_graphs=not config.enforce_eager,
        )
        self.proposer = create_proposer(config.speculative, ctx)
        spec = config.speculative
        # the target's pass cost by rows, timed on slot 0 before any sequence holds it
        target_cost = calibrate(self.decoder, self.kv) if spec.enabled and spec.adaptive else None
        self.prefix_cache = PrefixCache(config.max_num_seqs, enabled=config.enable_prefix_caching)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_queue, self.prefix_cache)
        self.stats = SpecStats()  # the whole run's counters
        # every sequence's drafts: the prior for a new one, itself started from the drafter's history
        self._history = history_path(config, self.decoder) if target_cost is not None and HISTORY_STEPS > 0 else None
        self._history_saved = time.monotonic()
        history = read_history(self._history)
        self.acceptance = Acceptance.from_dict(history.get("acceptance"), decay=0.99, steps=HISTORY_STEPS) or Acceptance(decay=0.99)
        self.eos_token_ids = set(self.model.config.eos_token_ids)
        # the runner commits each step's tokens under these rules and counts them into these counters
        self.runner = Runner(self.decoder, self.kv, self.proposer, target_cost,
                             StopRules(self.eos_token_ids, self.max_model_len), self.stats, self.acceptance)
        # adaptive, with a drafter whose passes cost time (a draft model, a head): whether speculating
        # pays at each batch size, measured step by step (plan.py). A free drafter (n-gram, suffix)
        # costs only the target rows its drafts add, which the refitted target model prices.
        self.switch = SpeculationSwitch() if target_cost is not None and self.proposer.cost is not None else None
        self._answer_tokens: float | None = None  # finished answers' length, a decayed mean
        # the passes on the cores other processes leave free (engine/threads.py), where the kernels run
        # the layers: their bits do not depend on the thread count
        on_kernels = self.decoder.device.type == "cpu" and self.decoder.native is not None
        self.threads = governor() if on_kernels else None
        self._ids = itertools.count()
        # structured outputs: grammars compiled for this tokenizer, cached by spec
        self.grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size) if self.tokenizer else None

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        if not prompt_token_ids:
            raise ConfigError("the prompt is empty", "prompt")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ConfigError(f"prompt token ids must lie in [0, {vocab})", "prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens, but the context holds {self.max_model_len}: "
                "no room is left to generate", "prompt",
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(request_id, list(prompt_token_ids), params, make_generator(params.seed, "cpu"))
        if params.structured is not None:
            if self.grammars is None:
                raise ConfigError("structured outputs need the model's tokenizer, and this model has none", "structured")
            seq.grammar = self.grammars.matcher(params.structured)
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need the model's tokenizer, and this model has none", "stop")
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(seq.output_token_ids, self.tokenizer.decode)
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (a client went away): its KV slot is free before this returns."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return None
        seq.finish("abort")
        self._release(seq)
        return seq.to_output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One target pass for every running sequence; the outputs of those that advanced."""
        seqs = self.scheduler.schedule()
        if not seqs:
            return []
        if self.threads is not None:
            self.threads.update()
        self._reuse_prefixes()
        started = time.perf_counter()
        # a decoding step (no prompt in it) is one the speculation switch chooses for and measures
        decoding = self.switch is not None and self._speculating(seqs) and all(s.num_pending == 1 for s in seqs)
        speculate = self.switch.speculate(len(seqs), lambda: self._plain_rate(seqs)) if decoding else self._switched_on(seqs)
        self._draft_reads_prompts(seqs)
        ks = self._num_draft(seqs) if speculate else [0] * len(seqs)
        results = self.runner.step(seqs, ks, self._forced_room(seqs))
        outputs = [self._postprocess(r) for r in results]
        if decoding:
            # a step the plan gave no drafts is plain decoding, whatever the mode: counted as
            # speculation, it would let a batch size where the plan never drafts look as if
            # speculating there paid (SpeculationSwitch.pays) and read every new prompt into the draft
            drafted = speculate and any(ks)
            seconds = time.perf_counter() - started + (sum(s.draft_read_charge for s in seqs) if drafted else 0.0)
            self.switch.record(len(seqs), drafted, sum(len(r.token_ids) for r in results), seconds)
        return outputs

    def _plain_rate(self, seqs: list[Sequence]) -> float:
        """Tokens per second the target's cost model predicts for a plain decoding step of ``seqs``."""
        cost = self.runner.target_cost
        return len(seqs) / max(cost(len(seqs), len(seqs), sum(key_reads(s.num_cached, 1) for s in seqs)), 1e-9)

    def _reuse_prefixes(self) -> None:
        """For each sequence admitted this step, in admission order: the proposer told of its cached
        prefix (engine/prefix_cache.py), and as much of it as the proposer starts from copied into
        its slot where it came from another. A prefix the proposer shortens (eagle3) is shortened
        before a later sequence of this step copies from the slot, so it copies only keys that exist."""
        for seq, placed in self.scheduler.take_placements():
            n = self.proposer.reuse(seq, placed.source, placed.num_tokens)
            self.kv.copy_prefix(placed.source, placed.slot, n)
            if n < placed.num_tokens:
                seq.num_cached = seq.num_reused = n
                self.prefix_cache.shorten(placed, n)

    def _draft_reads_prompts(self, seqs: list[Sequence]) -> None:
        """A proposer with its own model (``read_prompt``) reads each prompt in the step the target
        does, as vLLM's draft model does: the draft's prompt pass then counts in the time to first
        token, like the target's, instead of delaying the second token by a prefill of the draft
        (the 0.5B draft took 1.1 s to read 126 tokens on a 2-core AMD EPYC Zen 1). Not where the
        request takes no drafts, the batch has turned speculation off, or speculating was not yet
        measured to pay at this batch size of several (SpeculationSwitch); a prompt read in vain
        (the plan then drafts nothing for it) costs a draft prefill, which the draft would
        otherwise read at its first draft."""
        read = getattr(self.proposer, "read_prompt", None)
        if read is None or not self._switched_on(seqs):
            return
        if self.switch is not None and len(seqs) > 1 and not self.switch.pays(len(seqs)):
            # a batch not yet measured paying: the plan decides, pricing the read as catch-up (two
            # clients on the Qwen2.5-Coder pair: the draft's prompt reads took 1.17 s of a 13.6 s
            # run, more than its drafts gained)
            return
        prompts = [s for s in seqs if s.num_pending > 1 and self.draft_cap(s.params) > 0]
        if not prompts:
            return
        started = time.perf_counter()
        read(prompts)
        # the read is a cost of speculating: the switch charges each sequence's share of it to its
        # speculative steps, spread over the steps its answer is expected to take
        seconds, tokens = time.perf_counter() - started, sum(s.num_pending for s in prompts)
        odds = self.acceptance.odds(max(self.draft_cap(s.params) for s in prompts), PROBE_ACCEPTANCE)
        for s in prompts:
            answer = min(s.params.max_tokens, self._answer_tokens or s.params.max_tokens)
            steps = max(1.0, answer / odds.expected_tokens(self.draft_cap(s.params)))
            s.draft_read_charge = seconds * s.num_pending / tokens / steps

    def _speculating(self, seqs: list[Sequence]) -> bool:
        """Speculation is on, and this step's batch has not reached ``disable_by_batch_size``."""
        spec = self.config.speculative
        return spec.enabled and (spec.disable_by_batch_size is None or len(seqs) < spec.disable_by_batch_size)

    def _switched_on(self, seqs: list[Sequence]) -> bool:
        """Speculation is on for this batch, and the switch has not measured it losing at this size."""
        return self._speculating(seqs) and (self.switch is None or self.switch.preferred(len(seqs)))

    def draft_cap(self, params: SamplingParams) -> int:
        """The most draft tokens a step a request with ``params`` may take: the engine's K, or
        the request's own cap where it gives a smaller one."""
        k = self.config.speculative.num_speculative_tokens if self.config.speculative.enabled else 0
        return k if params.num_speculative_tokens is None else min(k, params.num_speculative_tokens)

    def _num_draft(self, seqs: list[Sequence]) -> list[int]:
        """K for each sequence this step: none on its prompt pass, never more than it can use,
        none when the batch has reached ``disable_by_batch_size``, and with ``adaptive`` as many
        as pay for themselves (engine/plan.py)."""
        spec = self.config.speculative
        if not self._speculating(seqs):
            return [0] * len(seqs)
        rooms = [min(s.params.max_tokens - len(s.output_token_ids), self.max_model_len - len(s)) for s in seqs]
        caps = [0 if s.num_pending != 1 else max(0, min(self.draft_cap(s.params), room - 1))
                for s, room in zip(seqs, rooms)]
        if not spec.adaptive or not any(caps):
            return caps
        # Before the engine has seen drafts, they are planned as a probe is (PROBE_ACCEPTANCE): a
        # neutral 0.5 planned one draft or none for the Qwen2.5-Coder pair's first request, and a
        # drafter not tried is not measured; a poor one shows itself within a few steps.
        # Odds depth by depth (plan.Acceptance): each sequence's shrunk towards the engine's, and
        # the engine's each depth towards the one before it.
        prior = self.acceptance.odds(max(caps), PROBE_ACCEPTANCE)
        # A sequence without drafts for probe_interval steps is planned as if its drafts were
        # good (with its whole cap: one draft token alone rarely pays for a draft model's pass):
        # a probe that fails costs its rows, one that succeeds shows that its text has turned
        # predictable.
        due = [s.steps_without_drafts >= spec.probe_interval for s in seqs]
        odds = [prior.at_least(PROBE_ACCEPTANCE) if d else s.acceptance.odds(cap, prior)
                for s, d, cap in zip(seqs, due, caps)]
        # The draft reads a sequence's unseen tokens once (its prompt, or what it missed while it
        # did not draft), and drafts from then on: that cost is shared by the steps still to come.
        catchup = [self.proposer.catchup_rows(s) for s in seqs]
        shares = [max(1.0, room / o.expected_tokens(cap)) for room, o, cap in zip(rooms, odds, caps)]
        ks = plan_draft_lengths(odds, caps, self.runner.target_cost, self.proposer.cost,
                                [s.num_pending for s in seqs], [s.num_cached for s in seqs], catchup, shares)
        # The costs start from a calibration kept per machine, model and kernel version, and one
        # timed on a busy machine can price drafts out for good: a draft never run is never timed
        # again. So until the refit has timed enough draft passes and verification passes, a due
        # probe drafts its whole cap whatever the plan says; after that the plan decides.
        # A probe is for timing drafts, so only a sequence whose draft is up to date is forced: one
        # the draft must first read at length (a prompt it did not read, or what it missed while its
        # batch decoded plainly) is left to the plan, which prices that catch-up.
        target, draft = self.runner.target_cost, self.proposer.cost
        untried = (target is not None and target.observed(min_rows=2) < TRUSTED_PASSES) or (
            draft is not None and draft.observed() < TRUSTED_PASSES)
        return [cap if d and untried and k == 0 and rows <= PROBE_CATCHUP else k
                for k, d, cap, rows in zip(ks, due, caps, catchup)]

    def _forced_room(self, seqs: list[Sequence]) -> list[int]:
        """The most forced grammar tokens each sequence may draft this step (structured.py): free
        to make and nearly always accepted, so they are drafted with speculation off too, unless
        the request turned speculation off for itself (``num_speculative_tokens: 0``)."""
        return [0 if s.grammar is None or s.params.num_speculative_tokens == 0 else
                max(0, min(MAX_FORCED_DRAFT, s.params.max_tokens - len(s.output_token_ids) - 1,
                           self.max_model_len - len(s) - 1)) for s in seqs]

    def _postprocess(self, r: StepResult) -> RequestOutput:
        """A committed step's output: its sequence's text brought up to date, and its slot released
        once it has finished."""
        seq = r.seq
        if r.error is None:
            if seq.detokenizer is not None and (seq.finish_reason != "stop" or not seq.params.stop):
                seq.detokenizer.update()  # (a stop string has already updated it and cut seq.text)
                seq.text = seq.detokenizer.text
        if seq.finished:
            self._release(seq)
            n = len(seq.output_token_ids)
            self._answer_tokens = n if self._answer_tokens is None else 0.9 * self._answer_tokens + 0.1 * n
            if not self.scheduler.has_unfinished() or time.monotonic() - self._history_saved > HISTORY_EVERY:
                self._save_history()
        return seq.to_output()

    def close(self) -> None:
        """Let the proposer write what must outlive the process (suffix's cache), and the drafter's
        acceptance; the engine is not stepped again."""
        self.proposer.close()
        self._save_history()

    def _save_history(self) -> None:
        """The engine's acceptance counts to the cache, for the next process: when a request
        finishes and none runs (a process may end with no close), else every HISTORY_EVERY s. A cache
        that cannot be written costs the next process its head start, nothing else."""
        self._history_saved = time.monotonic()
        if self._history is None or not self.acceptance.depths:
            return
        try:
            write_json(self._history, {"acceptance": self.acceptance.to_dict()})
        except OSError as e:
            log.warning("the drafter's history was not saved to %s: %s", self._history, e)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if seq.slot is not None:
            self.proposer.release(seq)

    def generate_ids(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts as one batch to completion; outputs in prompt order."""
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]


def history_path(config: EngineConfig, decoder: Decoder) -> Path:
    """Where the engine keeps its drafter's history between processes (its acceptance): one file
    for each target (its name and weights' size), speculative configuration, CPU, kernel path and
    device, so that another drafter, K or confidence threshold starts from its own, and a forced
    kernel path (QUICKDRAFT_ISA=avx2 on an AVX-512 CPU) keeps its own."""
    from quickdraft.kernels import cpu_model

    spec = {f.name: getattr(config.speculative, f.name) for f in dataclasses.fields(config.speculative)
            if f.name not in ("adaptive", "probe_interval")}
    # a drafter given loaded (LoadedModel) by its source, not its weights
    key = json.dumps({"model": config.model, "bytes": decoder.weight_bytes_per_token(), "dtype": str(config.dtype),
                      "speculative": spec, "cpu": cpu_model(), "path": decoder.batch_invariance.path,
                      "device": str(decoder.device)},
                     sort_keys=True, default=lambda v: getattr(v, "source", None) or repr(v))
    return cache_dir() / "acceptance" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def read_history(path: Path | None) -> dict:
    """The history at ``path``, or {} where there is none or it is damaged (the engine then starts
    from PROBE_ACCEPTANCE); its counts are checked where they are read (plan.Acceptance.from_dict)."""
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
