"""quickdraft: lossless speculative decoding for Llama, Mistral, Qwen and Gemma models, on CPU or GPU.

The public names are imported on first use (PEP 562), so that ``import quickdraft.<layer>`` loads
that layer and what it imports, not torch and the engine: ``quickdraft.kernels.isa`` is plain
Python, and a command that only parses its flags stays quick to start.
"""

from __future__ import annotations

import importlib

from quickdraft.version import __version__

# public name -> the module that defines it
_LAZY = {
    "LLM": "quickdraft.llm",
    "SamplingParams": "quickdraft.sampling",
    "RequestOutput": "quickdraft.engine.sequence",
    "EngineConfig": "quickdraft.config",
    "SpeculativeConfig": "quickdraft.config",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'quickdraft' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
