"""Verification of draft tokens against the target: lossless chain verification (``rejection``)
and its slow paper-faithful reference (``reference``, used by tests)."""

from quickdraft.verify.rejection import VerifyOutput, verify

__all__ = ["VerifyOutput", "verify"]
