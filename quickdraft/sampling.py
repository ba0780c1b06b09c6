"""Sampling parameters of one request, and logits -> probabilities.

Temperature, top-k and top-p shape the target's distribution p and the draft's distribution q in
exactly the same way, so that the verifier's min(1, p/q) compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quickdraft.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """Like vLLM's. ``temperature == 0`` means greedy (argmax); ``top_k <= 0`` and ``top_p == 1``
    disable those filters. ``seed`` seeds this request's own generator; None draws a fresh seed."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

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
        if self.seed is not None and not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
