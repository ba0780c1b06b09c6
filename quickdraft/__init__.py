"""quickdraft: lossless speculative decoding for llama / qwen2 models, on CPU or GPU."""

from quickdraft.engine.threads import passive_waits
from quickdraft.version import __version__

with passive_waits():  # quickdraft.llm imports torch, which loads the OpenMP runtime
    import torch  # noqa: F401

    from quickdraft.llm import LLM
    from quickdraft.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]
