"""quickdraft: lossless speculative decoding for llama / qwen2 models, on CPU or GPU."""

from quickdraft.engine.threads import use_passive_waits

# before quickdraft.llm imports torch, which loads the OpenMP runtime (see engine/threads.py)
use_passive_waits()

from quickdraft.llm import LLM  # noqa: E402
from quickdraft.sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]
