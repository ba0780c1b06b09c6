"""A peer's method (a way it generates, and what of quickdraft's it is set beside), shared by the
peers' child factories: peers.py (transformers, llama-cpp-python) and llama_server.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# each peer method -> the quickdraft method it is compared with
COUNTERPART = {"plain": "none", "assisted": "draft_model", "prompt_lookup": "ngram", "draft": "draft_model",
               "ngram_simple": "ngram", "ngram_map_k": "ngram", "ngram_mod": "ngram", "ngram_cache": "ngram"}


@dataclass
class PeerMethod:
    peer: str  # "transformers" | "llama_cpp" | "llama_server"
    method: str  # a key of COUNTERPART: "plain" | "assisted" | "prompt_lookup" | "draft" | "ngram_.."
    settings: dict
    generate: Callable[[list[int]], dict]  # prompt ids -> token_ids, timing

    @property
    def name(self) -> str:
        k = self.settings.get("k")
        return f"{self.peer} {self.method}" + (f" K={k}" if k else "")

    def info(self) -> dict:
        return {"name": self.name, "peer": self.peer, "method": self.method, "settings": self.settings,
                "counterpart_method": COUNTERPART[self.method]}
