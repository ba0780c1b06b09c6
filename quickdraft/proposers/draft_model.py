"""Method "draft_model": a smaller model of the same family, with its own KV cache, proposes K
tokens by decoding autoregressively (Leviathan et al. 2023; Chen et al. 2023).

It samples from its own distribution q under the request's sampling parameters (argmax when
greedy; under a request's grammar, q masked by the grammar walked along the draft's own tokens,
structured.py) and hands q on, so that the verifier's min(1, p/q) rule keeps the output distribution the
target's. The draft's cache is indexed by the same slot as the target's. ``_cached[slot]`` counts
the sequence's tokens whose keys are in the draft cache; a pass feeds it everything after that, so
after a rejection (or after the bonus token) the draft catches up in the first pass of the next
proposal, with no copy and no recomputation of what it already holds. A finished sequence's draft
keys stay in its slot with ``_cached[slot]`` for the prefix cache (engine/prefix_cache.py): a new
prompt that shares a prefix with them keeps them (``reuse``), in place or copied like the target's.

Three options trade nothing but speed: ``draft_confidence_threshold`` ends a sequence's draft
early once the draft's own probability of its token drops below it, ``quantization`` runs the
draft in int8 (models/quant.py), and ``draft_vocab_size`` (or ``draft_vocab_file``) truncates the
draft's output head to a subset of the vocabulary (proposers/draft_vocab.py): the draft's logits,
argmax and q are over the subset, mapped back to full ids, and q is handed on as the full-vocabulary
distribution it is, zero outside the subset. None of them can change the output: only the
target's verification decides.

With ``num_branches`` > 1 greedy requests draft token trees instead (``_grow_trees``, EAGLE-2's
dynamic trees, proposers/tree_drafts.py): a level a draft pass for the whole batch, each node over
its ancestors' keys in the draft cache (the tree attention's hidden keys), and after verification
the accepted path's keys moved into place (``KVCache.keep_path``), so the next proposal catches
up exactly as after a chain.

A draft with another tokenizer is refused here (``check_same_vocabulary``), unless the config asks
for ``cross_tokenizer``: then ``from_config`` builds proposers/draft_text.py's proposer, which drafts
through text.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from quickdraft.cost import calibrate, key_reads
from quickdraft.errors import ConfigError
from quickdraft.kv_cache import KVCache
from quickdraft.models.decoder import AttentionMetadata, Decoder
from quickdraft.models.ggml import BlockWeight, on_blocks, requantize_wider, wider
from quickdraft.models.kernels import block_linear
from quickdraft.models.loader import cached_blocks, ids_key, select_rows
from quickdraft.models import registry
from quickdraft.models.memory import into_huge_pages
from quickdraft.models.quant import quantizable
from quickdraft.proposers import draft_vocab
from quickdraft.proposers.base import DraftProposal, register
from quickdraft.proposers.tree_drafts import (DraftTreeState, EdgeCalibration, attach_level, chains_and_trees, next_level,
                                              top_children, tree_requests)
from quickdraft.sampling import BatchSampling, argmax_rows, draw_uniforms, logits_to_probs, sample_from_probs


# Draft passes that read a long catch-up (a prompt) run at prefill speed per row, not at the
# speed the plan prices draft tokens at: the cost model learns from the others only.
MAX_OBSERVED_FEED = 8
# the block format "auto" gives a draft on GGUF blocks that are stored in more bits a weight than it
AUTO_DRAFT_BLOCKS = "Q4_0"


@register("draft_model")
class DraftModelProposer:
    def __init__(self, draft: Decoder, num_slots: int, max_len: int, confidence_threshold: float = 0.0,
                 calibrate_cost: bool = False, head_ids: torch.Tensor | None = None, num_branches: int = 1):
        """``head_ids`` [N] int64: the full-vocabulary id of each row of ``draft``'s output head when
        the head is truncated (``truncated_head``); None: the head has every row. ``num_branches``
        > 1: greedy requests draft token trees (``_grow_trees``)."""
        self.model = draft
        self.branches = num_branches
        self._trees: dict[int, DraftTreeState] = {}  # slot -> the tree proposed this step, for observe
        self.edge_scale = EdgeCalibration()
        # trees this step (None: never; the runner turns them off while chains are measured faster)
        self.branching: bool | None = True if num_branches > 1 else None
        self.vocab_size = draft.config.vocab_size
        self.head_ids = None if head_ids is None else head_ids.to(draft.device)
        self.threshold = confidence_threshold
        self.kv = KVCache(draft.config, num_slots, max_len, draft.dtype, draft.device)
        self._cached = [0] * num_slots
        # one draft pass's seconds by rows, for the engine's K planning; refitted on every pass
        self.cost = calibrate(draft, self.kv) if calibrate_cost else None

    @classmethod
    def from_config(cls, spec, ctx):
        if spec.cross_tokenizer:  # a draft of any vocabulary, proposing through text
            from quickdraft.proposers.draft_text import TextDraftProposer

            return TextDraftProposer.from_config(spec, ctx)
        draft, config, weights, quantize, head_ids = load_draft(spec, ctx, check_vocabulary=True)
        return cls(Decoder(config, weights, quantize=quantize), ctx.num_slots, ctx.max_model_len,
                   spec.draft_confidence_threshold, calibrate_cost=spec.adaptive, head_ids=head_ids,
                   num_branches=spec.num_branches)

    def propose(self, seqs, num_tokens) -> DraftProposal:
        """Chains, and with ``num_branches`` > 1 a token tree for each greedy request that takes
        one (base.accepts_trees; why greedy only: proposers/tree_drafts.py)."""
        return chains_and_trees(seqs, num_tokens, tree_requests(seqs, num_tokens, self.branching),
                                self._propose_chains, self._grow_trees)

    def _propose_chains(self, seqs, num_tokens) -> DraftProposal:
        num_tokens = list(num_tokens)  # shortened below where the draft loses confidence
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        sampled = any(not seqs[i].params.greedy for i in active)
        feed = {i: seqs[i].token_ids[self._cached[seqs[i].slot] :] for i in active}
        # a grammar walks along the draft's own tokens, so that each is drawn under its mask; it
        # steps back before verification (structured.py, "draft masks")
        grammars = {i: seqs[i].grammar for i in active if seqs[i].grammar is not None}
        walked = dict.fromkeys(grammars, 0)
        try:
            for step in range(max(num_tokens, default=0)):
                active = [i for i in active if num_tokens[i] > step]
                if not active:
                    break
                started = time.perf_counter()
                timed = self.cost is not None and max(len(feed[i]) for i in active) <= MAX_OBSERVED_FEED
                if timed:
                    rows = sum(len(feed[i]) for i in active)
                    keys = sum(key_reads(self._cached[seqs[i].slot], len(feed[i])) for i in active)
                logits = self._forward([seqs[i] for i in active], [feed[i] for i in active])  # [len(active), N]
                ended = set()
                if grammars:
                    logits, ended = self._grammar_mask(logits, active, grammars)
                tokens, q = draw([seqs[i] for i in active], logits, sampled)  # rows of the head
                confident = confident_rows(logits, tokens, self.threshold)  # [len(active)] bool
                tokens, q = to_vocab(tokens, q, self.head_ids, self.vocab_size)  # ids [len(active)], q [len(active), V]
                tokens = tokens.tolist()
                if timed:
                    self.cost.observe(rows, time.perf_counter() - started, len(active), keys)
                for row, i in enumerate(active):
                    if i in ended:  # its grammar allows nothing more (or nothing the head has)
                        num_tokens[i] = step
                        continue
                    drafts[i].append(tokens[row])
                    if q is not None:
                        probs[i].append(q[row])
                    feed[i] = [tokens[row]]
                    if not confident[row]:
                        num_tokens[i] = step + 1  # this token is proposed, no more after it
                    if i in grammars:
                        if not grammars[i].advance(tokens[row]):
                            raise RuntimeError(f"the grammar refused draft token {tokens[row]} drawn under its mask: "
                                               f"{grammars[i].error}")
                        walked[i] += 1
        finally:
            for i, g in grammars.items():
                g.rollback(walked[i])
        flat = [t for d in drafts for t in d]
        q_all = torch.stack([p for ps in probs for p in ps]) if sampled and flat else None
        return DraftProposal(torch.tensor(flat, dtype=torch.long), [len(d) for d in drafts], q_all)

    def _grow_trees(self, seqs, budgets: list[int]) -> list[tuple[list[int], list[int], list[float]]]:
        """A token tree for each sequence, grown as EAGLE-2 does (Li et al. 2024, "dynamic draft
        trees"): a node's value is the draft's confidence in its whole path (the product of its
        edges' probabilities, scaled by ``edge_scale`` to what the target accepts); each level
        expands the ``num_branches`` most valuable nodes of the last one, each with its
        ``num_branches`` likeliest tokens, in one draft pass for the batch, and stops when no
        frontier node could still enter the best N; the best N nodes are proposed (a node's value
        never exceeds its parent's, so they form a tree). ``budgets`` [n]: the planned chain
        length K, which bounds the depth; N is K x num_branches, within the context. With one
        branch this is the greedy chain, token for token. -> (tokens, parents, values) each."""
        B = self.branches
        feeds = [s.token_ids[self._cached[s.slot]:] for s in seqs]
        trees = [DraftTreeState(self._cached[s.slot] + len(f)) for s, f in zip(seqs, feeds)]
        room = [self.kv.max_len - t.base - 1 for t in trees]
        sizes = [max(1, min(k * B, r)) for k, r in zip(budgets, room)]
        started = time.perf_counter()
        logits = self._forward(seqs, feeds)  # [n, N] after each sequence's last committed token
        self._observe_pass(started, seqs, feeds)
        for t, row in zip(trees, self._children(logits)):
            t.add_children(-1, row, self.edge_scale)
        for depth in range(1, max(budgets)):
            grow = next_level(trees, depth, B, sizes, room, budgets)  # (sequence, nodes to expand)
            if not grow:
                break
            started = time.perf_counter()
            logits = tree_pass(self.model, self.kv, [seqs[i].slot for i, _ in grow], [trees[i] for i, _ in grow],
                               [nodes for _, nodes in grow])
            if self.cost is not None:
                rows = sum(len(nodes) for _, nodes in grow)
                keys = sum(key_reads(trees[i].base + trees[i].written - len(nodes), len(nodes)) for i, nodes in grow)
                self.cost.observe(rows, time.perf_counter() - started, len(grow), keys)
            attach_level(trees, grow, self._children(logits), self.edge_scale)
        for s, t in zip(seqs, trees):
            self._trees[s.slot] = t
        return [t.best(n) for t, n in zip(trees, sizes)]

    def _children(self, logits: torch.Tensor) -> list[list[tuple[int, float]]]:
        return top_children(logits, self.branches, self.head_ids)

    def _observe_pass(self, started: float, seqs, feeds) -> None:
        """A draft pass that fed ``feeds`` timed for the cost model (unless it read a long catch-up)."""
        if self.cost is not None and max(len(f) for f in feeds) <= MAX_OBSERVED_FEED:
            keys = sum(key_reads(self._cached[s.slot] - len(f), len(f)) for s, f in zip(seqs, feeds))
            self.cost.observe(sum(len(f) for f in feeds), time.perf_counter() - started, len(seqs), keys)

    def _grammar_mask(self, logits: torch.Tensor, active: list[int], grammars: dict) -> tuple[torch.Tensor, set[int]]:
        """logits [n, N] with each grammar row's disallowed tokens at -inf (a copy), and the
        sequences whose grammar allows none of the head's tokens (their row is left as it was)."""
        allowed = torch.ones(logits.shape, dtype=torch.bool)  # [n, N]
        ended = set()
        for row, i in enumerate(active):
            if i in grammars:
                m = grammars[i].mask()  # [V]
                m = m if self.head_ids is None else m[self.head_ids.cpu()]
                if m.any():
                    allowed[row] = m
                else:
                    ended.add(i)
        return logits.masked_fill(~allowed.to(logits.device), float("-inf")), ended

    def _forward(self, seqs, feeds: list[list[int]]) -> torch.Tensor:
        """Run the draft over each sequence's unseen tokens; logits of each one's last row."""
        slots = [s.slot for s in seqs]
        logits = draft_pass(self.model, self.kv, slots, [self._cached[slot] for slot in slots], feeds)
        for slot, f in zip(slots, feeds):
            self._cached[slot] += len(f)
        return logits

    def observe(self, seqs, outcome) -> None:
        # Keys of draft tokens past the accepted prefix are stale; the next pass overwrites them.
        for s, accepted, tokens in zip(seqs, outcome.num_accepted, outcome.token_ids):
            tree = self._trees.pop(s.slot, None)
            if tree is None:
                self._cached[s.slot] = min(self._cached[s.slot], len(s) + accepted)
                continue
            # The target's token at each row the walk visited (its greedy choices: the accepted
            # nodes, then the bonus) against the draft's children there: the confidence calibration;
            # the accepted nodes the draft has keys for (those it expanded) moved into place.
            path = tree.walk(list(tokens), accepted)
            self.edge_scale.record(tree, path, list(tokens))
            fed = [tree.fed[n] for n in path if tree.fed[n] >= 0]
            self.kv.keep_path(s.slot, tree.base, fed)
            self._cached[s.slot] = tree.base + len(fed)

    def catchup_rows(self, seq) -> int:
        # after a draft with no rejection, or steps without drafting, the draft is behind by more than 1
        return max(len(seq) - self._cached[seq.slot] - 1, 0)

    def reuse(self, seq, source, num_tokens) -> int:
        # The source slot's draft keys cover its first _cached[source] committed tokens (clamped
        # to the committed ones by observe), of which the prompt shares num_tokens.
        held = min(self._cached[source], num_tokens)
        self.kv.copy_prefix(source, seq.slot, held)
        self._cached[seq.slot] = held
        return num_tokens

    def release(self, seq) -> None:
        self._trees.pop(seq.slot, None)  # the slot's draft keys stay for reuse; _cached[slot] says how many are valid

    def close(self) -> None:
        pass


def tree_pass(model: Decoder, kv: KVCache, slots: list[int], trees: list[DraftTreeState],
              nodes: list[list[int]]) -> torch.Tensor:
    """One draft pass over the next level of each tree: ``nodes[i]`` (just marked fed, so at
    ``base + fed``) each over the sequence's committed tokens, its ancestors (written by earlier
    passes: hidden keys, models/decoder/metadata.py's AttentionMetadata) and itself -> logits [rows, N]."""
    tokens, positions, masks, contexts = [], [], [], []
    for t, level in zip(trees, nodes):
        before = t.written - len(level)  # the tree's keys already in the cache
        mask = torch.zeros(len(level), before + len(level), dtype=torch.bool)
        for r, n in enumerate(level):
            a = t.parents[n]
            while a >= 0:
                mask[r, t.fed[a]] = True
                a = t.parents[a]
            mask[r, before + r] = True
            tokens.append(t.tokens[n])
            positions.append(t.base + t.depth[n] - 1)
        masks.append(mask)
        contexts.append(t.base + before)
    meta = AttentionMetadata(list(slots), contexts, [len(level) for level in nodes], masks)
    device = model.device
    hidden = model.forward(torch.tensor(tokens, dtype=torch.long, device=device),
                           torch.tensor(positions, dtype=torch.long, device=device), kv, meta)
    return model.logits(hidden)


def load_draft(spec, ctx, check_vocabulary: bool):
    """The draft of a speculative config, ready for a Decoder: (loaded model, config, weights,
    quantization, head_ids), with the config's device, int8 and truncated-head options resolved.
    ``check_vocabulary``: refuse a draft whose vocabulary is not the target's."""
    device = available_device(spec.draft_device or ctx.device)
    requant = "Q4_0" if spec.quantization == "q4_0" else None
    if spec.quantization == "auto" and _loads_on_blocks(spec.model, ctx, device):
        requant = AUTO_DRAFT_BLOCKS  # as below, but the loader's own cached conversion: no stored copy read first
    if requant and (torch.device(device).type != "cpu" or block_linear() is None):
        raise ConfigError('quantization "q4_0" runs the draft on the CPU\'s GGUF block kernels, '
                          f"which the draft's device {device!r} does not have", "quantization")
    draft = ctx.load_model(spec.model, device=device, requantize=requant)
    if check_vocabulary:
        check_same_vocabulary(ctx.target, draft)
    quantize = spec.quantization
    stored = on_blocks(draft.weights)
    if quantize == "auto":  # a GGUF draft kept in its stored blocks is smaller than int8 already
        on_cpu = torch.device(device).type == "cpu"  # the int8 kernel is a CPU kernel
        quantize = "int8" if on_cpu and quantizable() and ctx.dtype == torch.bfloat16 and not stored else None
        if stored and on_cpu and block_linear() is not None:
            # and is requantized to Q4_0 where it is stored wider: a draft step reads fewer bytes
            # (the Qwen 0.5B: 224 against 296 MiB). Three bench runs of the Qwen pair
            # (docs/features/4bit-drafts.md): 1.25x, 1.21x, 1.23x over plain decoding against 1.11x, 1.20x, 1.06x as stored
            requant = AUTO_DRAFT_BLOCKS
    if quantize == "int8" and stored:
        raise ConfigError("the draft runs on its stored GGUF blocks, which are smaller than int8: leave the "
                          'draft\'s "quantization" out, or load the models dequantized (--quantization none)',
                          "quantization")
    head_ids = draft_vocab.resolve(spec, draft)
    config, weights = (draft.config, draft.weights) if head_ids is None else truncated_head(draft, head_ids)
    if requant:
        weights, quantize = requantized(draft, weights, requant, "full" if head_ids is None else ids_key(head_ids)), None
    return draft, config, weights, quantize, head_ids


def _loads_on_blocks(model, ctx, device: str) -> bool:
    """Whether ``ctx.load_model`` will put the draft ``model``, a name or path, on the CPU's GGUF
    block kernels: a GGUF file (every built-in is one), loaded as the target was, on blocks."""
    if not isinstance(model, str) or torch.device(device).type != "cpu" or block_linear() is None:
        return False
    return on_blocks(ctx.target.weights) and (registry.is_builtin(model) or model.endswith(".gguf"))


def draft_pass(model: Decoder, kv: KVCache, slots: list[int], cached: list[int], feeds: list[list[int]]) -> torch.Tensor:
    """One draft pass: each slot's ``feeds`` tokens [len_i] at positions ``cached[i]``.. written
    into ``kv``; logits [len(slots), N] of each feed's last row."""
    meta = AttentionMetadata.chain(slots, cached, [len(f) for f in feeds])
    tokens = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=model.device)
    hidden = model.forward(tokens, meta.positions(model.device), kv, meta)
    last = torch.tensor(meta.query_lens).cumsum(0) - 1
    return model.logits(hidden[last.to(hidden.device)])


def draw(seqs, logits: torch.Tensor, sampled: bool):
    """logits [n, N] over the head's rows -> rows [n], and q [n, N] when any sequence of the
    batch samples (the request's temperature, top-k and top-p shape the head's N logits)."""
    if not sampled:
        return argmax_rows(logits), None
    batch = BatchSampling.from_params([s.params for s in seqs], logits.device)
    uniforms = torch.stack([draw_uniforms(s.generator, 1)[0] for s in seqs]).to(logits.device)
    return sample_draft(logits, batch, uniforms)


def confident_rows(logits: torch.Tensor, tokens: torch.Tensor, threshold: float) -> list[bool]:
    """[n] whether the draft's probability of its own token (at temperature 1) clears the
    threshold; the cutoff only shortens the draft, so any rule here keeps the output exact."""
    if threshold <= 0.0:
        return [True] * logits.shape[0]
    p = torch.softmax(logits, dim=-1).gather(1, tokens.view(-1, 1)).squeeze(1)
    return (p >= threshold).tolist()


def sample_draft(logits: torch.Tensor, batch: BatchSampling, uniforms: torch.Tensor):
    """logits [n, N] over the head's rows, the rows' sampling parameters [n] and uniforms [n]
    -> rows [n] (the argmax for greedy rows) and the q [n, N] they were drawn from."""
    q = logits_to_probs(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    return torch.where(batch.greedy, argmax_rows(logits), sample_from_probs(q, uniforms)), q


def available_device(name: str) -> str:
    """``name`` if this machine has that device, else a ConfigError that says what it has."""
    dev = torch.device(name)
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f'draft_device "{name}": this machine has no CUDA device (torch {torch.__version__})',
                              "draft_device")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f'draft_device "{name}": this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}',
                              "draft_device")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f'draft_device "{name}": MPS is not available here', "draft_device")
    elif dev.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise ConfigError(f'draft_device "{name}": no XPU device here', "draft_device")
    return name


def to_vocab(rows: torch.Tensor, q: torch.Tensor | None, head_ids: torch.Tensor | None, vocab_size: int):
    """Head rows [n] and q [n, N] -> full-vocabulary ids [n] and q [n, vocab_size]. With a
    truncated head (``head_ids`` [N]) q is the distribution the draft sampled from, zero outside the
    subset, so that the verifier's p/q and max(0, p - q) see exactly what was proposed."""
    if head_ids is None:
        return rows, q
    if q is not None:
        q = q.new_zeros(q.shape[0], vocab_size).index_copy_(1, head_ids, q)
    return head_ids[rows], q


def truncated_head(draft, ids: torch.Tensor):
    """(config, weights) of ``draft`` with an output head of only the rows ``ids`` [N]: a dense
    ``w[ids]`` or a GGUF ``BlockWeight.select(ids)``, chosen once at load. The embedding keeps
    every row (any token can be read), so a tied head becomes an untied one; int8 quantization,
    one scale per row, then quantizes the N rows alone, as selecting rows of the quantized head would."""
    w = dict(draft.weights)
    name = "model.embed_tokens.weight" if draft.config.tie_word_embeddings else "lm_head.weight"
    # a GGUF head's rows repacked once and kept in the cache (loader.select_rows), a dense one's indexed
    head = select_rows(draft, name, ids) if isinstance(w[name], BlockWeight) else w[name][ids].contiguous()
    w["lm_head.weight"] = into_huge_pages({"head": head})["head"]  # a new tensor: see models/memory.py
    return dataclasses.replace(draft.config, tie_word_embeddings=False), w


def requantized(draft, weights: dict, kind: str, head: str) -> dict:
    """``weights`` of a draft handed in already loaded, with every matrix wider than ``kind``
    requantized (``ggml.requantize_wider``; a draft loaded here by name comes requantized from
    the loader instead), made once and kept beside its conversion; ``head`` names the output
    head's rows."""
    names = [n for n, w in weights.items() if wider(w, kind)]
    if not names:
        return weights
    made = cached_blocks(draft, f"{kind.lower()}-{head}", lambda: requantize_wider({n: weights[n] for n in names}, kind))
    device = next(iter(weights.values())).device
    # the weights kept as they were are copied out of the loaded file's arena (fresh), which is
    # then freed instead of held by their views
    kept = into_huge_pages({n: w for n, w in weights.items() if n not in made}, fresh=True)
    return {**kept, **{n: w.to(device) for n, w in made.items()}}


def head_rows(head, ids: torch.Tensor):
    """The rows ``ids`` [N] of an output head: a dense ``w[ids]`` or a GGUF ``BlockWeight.select(ids)``."""
    head = head.select(ids) if isinstance(head, BlockWeight) else head[ids].contiguous()
    return into_huge_pages({"head": head})["head"]  # a new tensor: see models/memory.py


def check_same_vocabulary(target, draft) -> None:
    """A draft must speak the target's token ids, or its proposals mean nothing."""
    t, d = target.tokenizer, draft.tokenizer
    same = t.same_vocabulary(d) if t is not None and d is not None else t is d
    if target.config.vocab_size != draft.config.vocab_size or not same:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.config.vocab_size} tokens, {draft.source}) differs from "
            f"the target's ({target.config.vocab_size} tokens, {target.source}); a draft must share the "
            "target's tokenizer, or propose through text: add \"cross_tokenizer\": true to the speculative config "
            "(universal assisted generation: drafts re-encoded with the target's tokenizer)", "model",
        )

