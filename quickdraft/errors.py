"""Errors that are the user's to fix: the CLI prints their message and exits with code 2, the
server answers them with an HTTP 4xx in OpenAI's error format. Anything else is a bug."""

from __future__ import annotations


class QuickdraftError(Exception):
    """Base of every user-facing error. ``param`` names the offending input where there is one."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(QuickdraftError):
    """A bad engine, speculative or sampling parameter."""


class UnknownModelError(QuickdraftError):
    """Neither a built-in model name nor an existing file or directory."""

    status_code = 404
    error_type = "not_found_error"


class ModelNotInstalledError(QuickdraftError):
    """A built-in model whose PyPI packages are not installed; the message holds the pip line."""


class ChecksumError(QuickdraftError):
    """A model file whose sha256 differs from the registry's; the message names the file."""


class ModelFormatError(QuickdraftError):
    """A file that is not a model quickdraft can read (bad GGUF, unknown architecture or tensor type)."""


class PromptTooLongError(QuickdraftError):
    """A prompt that leaves no room to generate within the context length."""
