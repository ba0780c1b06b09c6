"""quickdraft: lossless speculative decoding for llama / qwen2 models, on CPU or GPU."""

from quickdraft.engine.threads import passive_waits

with passive_waits():  # quickdraft.llm imports torch, which loads the OpenMP runtime
    import torch  # noqa: F401

    from quickdraft.llm import LLM
    from quickdraft.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]
