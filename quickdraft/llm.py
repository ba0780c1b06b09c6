"""``LLM``: the offline Python API, shaped like vLLM's.

    from quickdraft import LLM, SamplingParams
    llm = LLM("qwen2.5-coder-1.5b-instruct",
              speculative_config={"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct",
                                  "num_speculative_tokens": 4})
    outputs = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=64, temperature=0))
"""

from __future__ import annotations

from quickdraft.config import EngineConfig, SpeculativeConfig
from quickdraft.engine.engine import Engine
from quickdraft.engine.sequence import RequestOutput
from quickdraft.engine.threads import set_threads
from quickdraft.models.loader import LoadedModel
from quickdraft.sampling import SamplingParams


def build_engine(config: EngineConfig, target: LoadedModel | None = None) -> tuple[Engine, str]:
    """The engine for ``config``, and the line saying the max model len it runs at and why
    (``Engine.max_model_len_reason``)."""
    engine = Engine(config, target=target)
    return engine, engine.max_model_len_reason


class LLM:
    """A target model with its drafter, ready to generate: the engine of ``quickdraft serve``
    without the server. Not thread-safe: one ``generate`` or ``chat`` at a time."""

    def __init__(self, model: "str | LoadedModel", speculative_config: "dict | str | SpeculativeConfig | None" = None,
                 dtype: str = "bfloat16", device: str = "cpu", max_model_len: int | None = None,
                 max_num_seqs: int = 8, quantization: str | None = "auto", enable_prefix_caching: bool = True,
                 threads: int | None = None, enforce_eager: bool = False):
        """``model``: a built-in name (``quickdraft models``), a ``.gguf`` file or a Hugging Face
        directory, or a model already loaded. ``speculative_config``: the drafter, as a dict or as
        the JSON of ``--speculative-config`` (None: plain decoding). ``dtype``: the activations'
        (``bfloat16``, ``float16``, ``float32``). ``quantization``: ``auto`` runs a GGUF model on its
        stored blocks where the CPU kernels run, ``None`` dequantizes to ``dtype``. ``max_num_seqs``:
        the sequences decoded together (the KV cache holds that many). ``enable_prefix_caching``:
        reuse the keys of a prompt's prefix seen before. ``enforce_eager``: no CUDA graphs.

        ``threads``: CPU threads for torch and the kernels, process-wide (default: torch's, one per
        physical core this process may run on). ``max_model_len``: None, the model's context length,
        less where the KV cache of ``max_num_seqs`` sequences would not fit in the memory left after
        the weights or, on a CPU, in 4 GiB (``max_model_len_reason`` says which); a length given
        beyond the model's context or the memory is an error."""
        if threads is not None:
            set_threads(threads)
        name = model if isinstance(model, str) else model.source
        config = EngineConfig(
            model=name, dtype=dtype, device=device, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_queue=1 << 30, speculative=SpeculativeConfig.parse(speculative_config), quantization=quantization,
            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
        )
        self.engine, self.max_model_len_reason = build_engine(config, None if isinstance(model, str) else model)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Save what the proposer keeps across runs (``suffix_decoding_cache_path``); also on ``with``'s exit."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: "str | list[str] | list[list[int]]",
                 sampling_params: "SamplingParams | list[SamplingParams] | None" = None) -> list[RequestOutput]:
        """Prompts (text, or token ids) run together as one batch; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(ids)
        return self.engine.generate_ids(ids, params)

    def chat(self, messages: "list[dict] | list[list[dict]]",
             sampling_params: "SamplingParams | list[SamplingParams] | None" = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or several, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate([self.tokenizer.encode(p) for p in prompts], sampling_params)
