"""Sampling parameters of one request, and logits -> probabilities.

Temperature, top-k and top-p shape the target's distribution p and the draft's distribution q in
exactly the same way, so that the verifier's min(1, p/q) compares like with like.

Every random draw is a function of explicit uniforms in [0, 1) (``sample_from_probs``): a request's
own ``torch.Generator`` (``make_generator``) produces them (``draw_uniforms``), and the verifier
only consumes them. That is what makes seeded runs reproducible and lets tests replay a draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from quickdraft.errors import ConfigError
from quickdraft.structured import StructuredSpec


MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


@dataclass(frozen=True)
class SamplingParams:
    """Like vLLM's. ``temperature == 0`` means greedy (argmax); ``top_k <= 0`` and ``top_p == 1``
    disable those filters. ``seed`` seeds this request's own generator; None draws a fresh seed.
    ``num_speculative_tokens`` caps this request's draft tokens a step (speculation changes only
    the speed, never the output)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # vLLM's: drop tokens less likely than min_p times the most likely one (0: off)
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # this request's cap on draft tokens a step: None, the engine's num_speculative_tokens; 0,
    # plain decoding; a larger value than the engine's is capped there (a cap, never a raise)
    num_speculative_tokens: int | None = None
    # None: no log-probabilities; N >= 0: each output token's, and the N most likely at its position
    # (the target's raw distribution, before temperature, top-k, top-p, min_p and penalties, as vLLM reports it)
    logprobs: int | None = None
    # the same for the prompt's tokens (the first has none), from the prompt's pass
    prompt_logprobs: int | None = None
    # rules on the logits by the text so far (verify/penalties.py): OpenAI's presence and frequency
    # penalties (over the output), vLLM's repetition penalty (prompt and output), a logit bias
    # ((token id, amount) pairs; a dict is taken too), and no end of sequence before min_tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # what the output must match (a JSON schema, a regex, a grammar: quickdraft/structured.py);
    # the target is masked to it at every verified position
    structured: StructuredSpec | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise ConfigError(f"temperature must be in [0, 100], got {self.temperature!r}", "temperature")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ConfigError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}", "top_k")
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}", "seed")
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in self.logit_bias.items())))
        elif self.logit_bias is None:
            object.__setattr__(self, "logit_bias", ())
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}", name)
        if not 0.0 < float(self.repetition_penalty) <= 10.0:
            raise ConfigError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}", "repetition_penalty")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ConfigError("logit_bias values must be in [-100, 100]", "logit_bias")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens}), got {self.min_tokens!r}",
                              "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS):
                raise ConfigError(f"{name} must be an integer in 0..{MAX_LOGPROBS}, got {n!r}", name)
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise ConfigError(f"num_speculative_tokens must be an integer >= 0 (0: no speculation), got {k!r}",
                              "num_speculative_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class BatchSampling:
    """The sampling parameters of a batch as tensors, one row per sequence (or per target row,
    after ``select``). Same meanings as ``SamplingParams``."""

    temperature: Tensor  # [batch] float32, 0 = greedy
    top_k: Tensor  # [batch] int64, <= 0 = off
    top_p: Tensor  # [batch] float32, 1 = off
    min_p: Tensor  # [batch] float32, 0 = off

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> BatchSampling:
        return cls(
            temperature=torch.tensor([float(s.temperature) for s in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([int(s.top_k) for s in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([float(s.top_p) for s in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([float(s.min_p) for s in params], dtype=torch.float32, device=device),
        )

    @property
    def greedy(self) -> Tensor:  # [batch] bool
        return self.temperature == 0

    def __len__(self) -> int:
        return self.temperature.shape[0]

    def to(self, device: torch.device | str) -> BatchSampling:
        return BatchSampling(self.temperature.to(device), self.top_k.to(device), self.top_p.to(device), self.min_p.to(device))

    def select(self, index: Tensor) -> BatchSampling:
        """The rows ``index`` ([n] int64), e.g. each sequence's row repeated for its K + 1 positions."""
        return BatchSampling(self.temperature[index], self.top_k[index], self.top_p[index], self.min_p[index])


def logits_to_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                    min_p: Tensor | None = None) -> Tensor:
    """Shaped probabilities [N, V] float32 from ``logits`` [N, V] (any float dtype; computed in
    float32) with per-row ``temperature`` [N], ``top_k`` [N], ``top_p`` [N] and ``min_p`` [N].

    Order: divide by temperature, keep the top-k, then keep the top-p nucleus of what is left
    (the smallest set of highest tokens whose mass is >= top_p; ties at a cut-off are kept, see
    ``_top_k_top_p``), softmax, then drop what is less likely than min_p times the most likely
    token and renormalize. Rows with temperature 0 are greedy: a one-hot at the argmax (lowest
    id on ties). V can be 151936 and this runs for every token: without filtering rows there is no
    sort at all, with them a partial one (torch.topk), a full sort only where that is too narrow.

    On the CPU the kernels do it all by the same rule (kernels/rowwise.h's shaped_row: their own
    exponent, the same bits on every ISA), and the draft's native chains take the same one. No row
    is sorted there: with sample_from_probs's draw, a 151,936-logit row took 0.45 ms against
    torch's 1.9 at a temperature alone (AMD EPYC Zen 1); this function alone took 0.44 ms against
    2.3 under top-p 0.9, and 0.41 against 15.7 under top-k 50 (real draft logits, Intel Xeon).
    """
    kernels = row_kernels(logits)
    if kernels is not None:
        return kernels.softmax_rows(logits.contiguous(), temperature.float().contiguous(), top_k.long().contiguous(),
                                    top_p.float().contiguous(), None if min_p is None else min_p.float().contiguous())
    logits = logits.float()  # [N, V]
    greedy = temperature == 0  # [N]
    if bool(greedy.all()):
        return _one_hot_argmax(logits)
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)  # [N, V]
    vocab = logits.shape[-1]
    filtered = ~greedy & (((top_k > 0) & (top_k < vocab)) | (top_p < 1))  # [N]
    if bool(filtered.all()):
        scaled = _top_k_top_p(scaled, top_k, top_p)
    elif bool(filtered.any()):
        rows = filtered.nonzero().squeeze(1)  # [M]
        scaled[rows] = _top_k_top_p(scaled[rows], top_k[rows], top_p[rows])
    probs = torch.softmax(scaled, dim=-1)  # [N, V]
    if min_p is not None and bool(((min_p > 0) & ~greedy).any()):
        floor = (min_p * probs.max(dim=-1).values).unsqueeze(1)  # [N, 1]; 0 where off
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if bool(greedy.any()):
        probs = torch.where(greedy.unsqueeze(1), _one_hot_argmax(logits), probs)
    return probs


def row_kernels(x: Tensor):
    """The CPU kernels' module where it takes ``x`` (a [N, V] float32 or bfloat16 CPU tensor), else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or x.shape[1] == 0:
        return None
    from quickdraft.kernels import rowwise

    return rowwise()


def _one_hot_argmax(logits: Tensor) -> Tensor:
    """[N, V] float32 one-hot at each row's argmax of ``logits`` [N, V] (lowest id on ties)."""
    return torch.zeros_like(logits).scatter_(1, argmax_rows(logits).unsqueeze(1), 1.0)


def argmax_rows(x: Tensor) -> Tensor:
    """[N] int64: each row's argmax of ``x`` [N, V], the lowest index on ties (a NaN counts as the
    largest), as ``x.argmax(-1)``. On the CPU numpy's vectorized argmax does it: torch's took
    ~0.2 ms a 151,936-token row, and under a shared machine its threads waited ms for each other
    (AMD EPYC, 2 cores), against ~15 us for numpy's; the answer is the same."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() == 2 and not x.requires_grad:
        return torch.from_numpy(x.numpy().argmax(-1).astype(np.int64, copy=False))
    return x.argmax(-1)


def argmax_finite(x: Tensor) -> tuple[Tensor, Tensor | None]:
    """(argmax_rows(x) [N], and [N] bool whether each row of ``x`` [N, V] is finite, or None). On
    the CPU the kernels take both from one read of the rows (kernels/verify.cpp); elsewhere only
    the argmax is taken, and the caller checks the rows as it would have."""
    kernels = row_kernels(x)
    if kernels is not None:
        return kernels.argmax_finite(x.contiguous())
    return argmax_rows(x), None


# The top-k set and the top-p nucleus are first looked for among the highest logits only (a
# partial sort, torch.topk): top_k + 1 of them for top-k rows, this many for rows with top-p alone.
# Only rows whose set may reach past the candidates (ties at the edge, or a nucleus that the
# candidates' mass does not cover) pay for a full sort of the vocabulary.
_CANDIDATES = 1024


def _top_k_top_p(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """``scaled`` [M, V] with every token below its row's cut-off value set to -inf.

    The top-k cut-off is the k-th highest value; the top-p cut-off is the value of the last token
    of the nucleus, the shortest descending prefix (after the top-k cut, renormalized) whose mass
    is >= top_p, so the top token always stays. A token tied with a cut-off value is kept (as HF's
    and vLLM's top-k do): the kept set then depends on the values only, never on how a sort orders
    equal ones, and ties make it at most larger.
    """
    vocab = scaled.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)  # [M]
    width = min(vocab, int(torch.where(k_on, top_k + 1, _CANDIDATES).max()))
    cutoff, too_narrow = _cutoffs(scaled, top_k, top_p, width)  # [M] each
    if bool(too_narrow.any()):
        rows = too_narrow.nonzero().squeeze(1)  # [W]
        cutoff[rows] = _cutoffs(scaled[rows], top_k[rows], top_p[rows], vocab)[0]
    return scaled.masked_fill(scaled < cutoff.unsqueeze(1), float("-inf"))


def _cutoffs(scaled: Tensor, top_k: Tensor, top_p: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Per row, the smallest value kept [M] float32, and whether ``width`` candidates were too few
    to know it [M] bool (never at width == V)."""
    vocab = scaled.shape[-1]
    if width == vocab:
        values = scaled.sort(dim=-1, descending=True).values  # [M, V]
    else:
        values = scaled.topk(width, dim=-1).values  # [M, width], descending
    k_on = (top_k > 0) & (top_k < vocab)  # [M]
    kth = values.gather(1, (top_k.clamp(1, width) - 1).unsqueeze(1)).squeeze(1)  # [M]
    kth = torch.where(k_on, kth, float("-inf"))
    # Candidate masses after the top-k cut, renormalized: over the top-k set, which lies among the
    # candidates unless its ties reach past them (too narrow then), else over the whole vocabulary.
    cut = values < kth.unsqueeze(1)  # [M, width]
    log_total = torch.logsumexp(values.masked_fill(cut, float("-inf")), dim=-1)  # [M]
    if not bool(k_on.all()):
        log_total = torch.where(k_on, log_total, torch.logsumexp(scaled, dim=-1))
    mass = (values - log_total.unsqueeze(1)).exp().masked_fill(cut, 0.0).double()  # [M, width]
    cumulative = mass.cumsum(dim=-1)  # [M, width]
    before = torch.cat([cumulative.new_zeros(cumulative.shape[0], 1), cumulative[:, :-1]], dim=-1)  # [M, width]
    p_on = top_p < 1  # [M]
    in_nucleus = before < top_p.double().unsqueeze(1)  # [M, width]
    # clamp: a top_p that float32 rounds to 0 (5e-324) still keeps the top token
    last = values.gather(1, (in_nucleus.sum(-1) - 1).clamp_min(0).unsqueeze(1)).squeeze(1)  # [M]
    cutoff = torch.maximum(kth, torch.where(p_on, last, float("-inf")))  # [M]
    too_narrow = (k_on & (values[:, -1] >= kth)) | (p_on & (cumulative[:, -1] < top_p.double()))
    return cutoff, too_narrow & (width < vocab)


def head_columns(ids: Tensor, vocab_size: int) -> Tensor:
    """A truncated draft head's ids [N] -> each vocabulary id's row of the head [vocab_size] int32,
    -1 for the ids it lacks: the columns of a q over the head (DraftProposal.probs_columns)."""
    columns = torch.full((vocab_size,), -1, dtype=torch.int32, device=ids.device)
    columns[ids] = torch.arange(ids.shape[0], dtype=torch.int32, device=ids.device)
    return columns


def spread_probs(probs: Tensor, columns: Tensor) -> Tensor:
    """q [n, N] over a head's rows and ``columns`` [vocab_size] (head_columns) -> q [n, vocab_size],
    0 for the ids the head lacks."""
    columns = columns.to(probs.device)
    spread = probs[:, columns.clamp(min=0).long()]
    return spread.masked_fill_((columns < 0).view(1, -1), 0.0)


def sample_from_probs(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Token ids [N] int64 drawn from ``probs`` [N, V] by inverse CDF with ``uniforms`` [N] float64
    in [0, 1): the first token whose cumulative mass exceeds u * total.

    ``probs`` need not be normalized (the draw is proportional to it, which is how
    normalize(max(0, p - q)) is sampled without a division), but each row needs positive mass.
    A token with zero probability is never returned: its cumulative mass equals its
    predecessor's, and u * total is kept strictly below the total so u -> 1 cannot run off the end.
    On the CPU, for float32 probs, the kernels draw by the same rule with the float64 cumulative
    mass summed by blocks of 256 (kernels/rowwise.h's sample_row: one block walked, not the row).
    """
    kernels = row_kernels(probs) if probs.dtype == torch.float32 else None
    if kernels is not None:
        return kernels.sample_probs(probs, uniforms.to(torch.float64).cpu())
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    below_total = torch.nextafter(total, torch.zeros_like(total))  # [N, 1]
    point = torch.minimum(uniforms.to(cdf).unsqueeze(1) * total, below_total)  # [N, 1]
    ids = torch.searchsorted(cdf, point, right=True).squeeze(1)  # [N]
    return ids.clamp_(max=probs.shape[-1] - 1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own generator: seeded with ``seed``, or with a fresh random seed if None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def draw_uniforms(generator: torch.Generator, n: int) -> Tensor:
    """[n] float64 uniforms in [0, 1) from ``generator``, on its device."""
    return torch.rand(n, generator=generator, dtype=torch.float64, device=generator.device)
