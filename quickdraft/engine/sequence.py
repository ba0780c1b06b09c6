"""One request's state while it decodes, its speculative counters, and what the engine reports."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from quickdraft.engine.detokenizer import IncrementalDetokenizer
from quickdraft.engine.plan import Acceptance
from quickdraft.sampling import SamplingParams
from quickdraft.structured import GrammarMatcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Counters of one request (or, summed, of a run).

    A *target pass* is one forward pass of the target over this sequence's new tokens (the prompt
    pass included); every pass emits at least one token, so ``mean_accepted_length`` (tokens per
    target pass, the bonus or recovered token counted) is 1.0 for plain decoding."""

    num_target_passes: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    # [K] passes with a draft at position j (a token tree's nodes at depth j + 1 count once)
    drafts_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)  # [K] of those, accepted

    def record(self, num_drafts: int, num_accepted: int, num_emitted: int, positions: int | None = None) -> None:
        """``positions``: the draft positions the step filled, a tree's depth (default: a chain's drafts)."""
        positions = num_drafts if positions is None else positions
        self.num_target_passes += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted
        grow = positions - len(self.drafts_per_position)
        if grow > 0:
            self.drafts_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j in range(positions):
            self.drafts_per_position[j] += 1
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def merge(self, other: "SpecStats") -> None:
        for j in range(len(other.drafts_per_position)):
            if j >= len(self.drafts_per_position):
                self.drafts_per_position.append(0)
                self.accepted_per_position.append(0)
            self.drafts_per_position[j] += other.drafts_per_position[j]
            self.accepted_per_position[j] += other.accepted_per_position[j]
        self.num_target_passes += other.num_target_passes
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.num_emitted_tokens / self.num_target_passes if self.num_target_passes else 0.0

    def to_dict(self) -> dict:
        return {
            "num_target_passes": self.num_target_passes,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_per_position": [
                a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafts_per_position)
            ],
        }


@dataclass
class TokenLogprob:
    """An output token's log-probability under the target (its raw distribution at that position,
    from the pass that verified it: the same as plain decoding's), and the ``top`` most likely
    tokens there, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """What a request has produced so far; ``new_token_ids`` are those of the latest step."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    spec: SpecStats
    error: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[TokenLogprob] | None = None  # one a token of token_ids, when the request asked for them
    new_logprobs: list[TokenLogprob] | None = None  # those of new_token_ids
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one a prompt token (the first: None), if asked
    eos_token_id: int | None = None  # the end-of-sequence token that stopped it (never in token_ids)
    eos_logprob: TokenLogprob | None = None  # that token's logprob, when the request asked for logprobs
    num_cached_tokens: int = 0  # prompt tokens whose keys came from the prefix cache (vLLM's name)


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # params.logprobs is not None: one a token
    prompt_logprobs: list[TokenLogprob | None] | None = None  # params.prompt_logprobs: set by the prompt's pass
    eos_token_id: int | None = None  # the end of sequence that finished it: not output, but sampled and counted
    eos_logprob: TokenLogprob | None = None  # its logprob, where params.logprobs asks for them
    status: Status = Status.WAITING
    slot: int | None = None
    num_cached: int = 0  # tokens of token_ids whose keys/values are in the target's cache
    num_reused: int = 0  # of the prompt's, those found in the prefix cache at admission
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    first_token_time: float | None = None
    finish_time: float | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)  # its recent drafts' fate (engine/plan.py)
    steps_without_drafts: int = 0  # decoding steps since its last draft (for probing)
    # seconds the draft spent reading its prompt, spread over the decoding steps it is expected to
    # take: what each speculative step of it costs besides its pass (engine.py, SpeculationSwitch)
    draft_read_charge: float = 0.0
    grammar: GrammarMatcher | None = None  # params.structured's state after output_token_ids
    detokenizer: IncrementalDetokenizer | None = None  # output_token_ids' text, kept up to date by the engine
    _reported: int = 0  # output tokens already handed out in a RequestOutput
    _token_ids: list[int] = field(init=False, repr=False)  # prompt + output, appended as the output grows

    def __post_init__(self) -> None:
        self._token_ids = self.prompt_token_ids + self.output_token_ids

    def append(self, token: int) -> None:
        """Add one output token (to ``output_token_ids`` and ``token_ids`` alike)."""
        self.output_token_ids.append(token)
        self._token_ids.append(token)

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output as one list, appended to rather than rebuilt at every call: read it,
        never change it. Rebuilt only where the output was changed without ``append``."""
        if len(self._token_ids) != len(self):
            self._token_ids = self.prompt_token_ids + self.output_token_ids
        return self._token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """len(pending_token_ids), without building the list."""
        return len(self) - self.num_cached

    @property
    def pending_token_ids(self) -> list[int]:
        """Tokens the target has not seen yet: the prompt at first, then the last emitted token."""
        return self.token_ids[self.num_cached :]

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.perf_counter()

    def to_output(self) -> RequestOutput:
        start, self._reported = self._reported, len(self.output_token_ids)
        wanted = self.params.logprobs is not None
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.output_token_ids), new_token_ids=self.output_token_ids[start:], text=self.text,
            finished=self.finished, finish_reason=self.finish_reason, spec=self.spec, error=self.error,
            arrival_time=self.arrival_time, first_token_time=self.first_token_time, finish_time=self.finish_time,
            logprobs=list(self.output_logprobs) if wanted else None,
            new_logprobs=self.output_logprobs[start:] if wanted else None, prompt_logprobs=self.prompt_logprobs,
            eos_token_id=self.eos_token_id, eos_logprob=self.eos_logprob, num_cached_tokens=self.num_reused,
        )
