"""quickdraft: lossless speculative decoding for llama / qwen2 models, on CPU or GPU."""

from quickdraft.engine.threads import fit_to_quota, passive_waits
from quickdraft.version import __version__

with passive_waits():  # quickdraft.llm imports torch, which loads the OpenMP runtime
    import torch  # noqa: F401

    from quickdraft.llm import LLM
    from quickdraft.sampling import SamplingParams
fit_to_quota()  # a container's CPU limit, not the node's cores (engine/threads.py)

__all__ = ["LLM", "SamplingParams", "__version__"]
