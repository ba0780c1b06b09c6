"""The decoder-only transformer (llama / qwen2 family), in parts:

- ``model.py``: ``Decoder``, the model a pass goes through (embedding, layers, final norm; logits
  a separate call);
- ``metadata.py``: ``AttentionMetadata``, where a ragged batch's new tokens go, and token trees;
- ``ops.py``: ``linear``, ``rms_norm``, ``Rotary``: row-wise operations in every weight format;
- ``reference.py``: the layers in Python, one kernel call an operation: the readable reference;
- ``native.py``: the same layers on the CPU kernels in C++, a whole pass in one call.
"""

from quickdraft.models.decoder.metadata import (AttentionMetadata, attention_mask, pass_trees, tree_paths,
                                                 tree_paths_from_parents)
from quickdraft.models.decoder.model import EMBED_CACHE_ROWS, Decoder
from quickdraft.models.decoder.native import NativeLayers
from quickdraft.models.decoder.ops import ROW_MULTIPLE, Rotary, _bmm_rows, _pad_rows, linear, nbytes, rms_norm
from quickdraft.models.decoder.reference import CHAIN_HEAD_DIMS, MAX_ROW_BY_ROW, ReferenceLayers

__all__ = ["AttentionMetadata", "CHAIN_HEAD_DIMS", "Decoder", "EMBED_CACHE_ROWS", "MAX_ROW_BY_ROW", "NativeLayers",
           "ROW_MULTIPLE", "ReferenceLayers", "Rotary", "attention_mask", "linear", "nbytes", "pass_trees", "rms_norm",
           "tree_paths", "tree_paths_from_parents", "_bmm_rows", "_pad_rows"]
