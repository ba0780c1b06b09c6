"""quickdraft: lossless speculative decoding for Llama, Mistral, Qwen and Gemma models, on CPU or GPU."""

from quickdraft.engine.threads import fit_to_quota
from quickdraft.llm import LLM
from quickdraft.sampling import SamplingParams
from quickdraft.version import __version__

fit_to_quota()  # a container's CPU limit, not the node's cores (engine/threads.py)

__all__ = ["LLM", "SamplingParams", "__version__"]
