"""Verification of draft tokens against the target: the one call a step the engine makes
(``step.verify_step``: finiteness, uniforms, then greedy, rejection sampling or trees), lossless
chain verification (``rejection``), token trees (``tree``) and the slow paper-faithful reference
(``reference``, used by tests)."""

from quickdraft.verify.rejection import VerifyOutput, expected_tokens, verify
from quickdraft.verify.step import verify_step

__all__ = ["VerifyOutput", "expected_tokens", "verify", "verify_step"]
