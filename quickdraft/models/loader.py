"""``load_model``: a built-in name, a ``.gguf`` file or a Hugging Face directory -> LoadedModel.

GGUF files go through a conversion cache. Dequantizing a GGUF in numpy takes from seconds
(135M parameters) to minutes (1.5B), so the first load writes the result under
``$QUICKDRAFT_CACHE/converted/<stem>-<fingerprint>/`` as ``weights-<dtype>.safetensors`` plus
``config.json`` and ``tokenizer.json``; later loads read those and never open the GGUF. Every file
is written to a temporary name and renamed, so an interrupted conversion leaves no half file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
import warnings
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from quickdraft.errors import ModelFormatError
from quickdraft.models import gguf as gguf_loader
from quickdraft.models import hf as hf_loader
from quickdraft.models import registry
from quickdraft.models.config import ModelConfig
from quickdraft.models.ggml import BlockWeight, requantize_wider
from quickdraft.kernels import block_linear
from quickdraft.models.memory import into_huge_pages, read_safetensors
from quickdraft.models.rope import RopeScaling
from quickdraft.models.tokenizer import Tokenizer

# Bump when the conversion itself changes (names, unpermute, tokenizer building), so that old
# cache entries are not read as if they were produced by the new code. 2: GGUF blocks in tiles of
# 16 weight rows (models/ggml.py). 3: tokenizer.json keeps the tokenizers document as a string
# (Tokenizer.to_json), which version 2's code cannot read: a cache shared by two versions keeps
# an entry for each. 4: the families (families.py): Gemma's norms in float32, rope_freqs read into
# the config.
CONVERTER_VERSION = 4
_SAMPLE = 1 << 20  # bytes hashed at the start, middle and end of a file for its fingerprint
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class LoadedModel:
    """A model ready for the decoder: weights by Hugging Face name, in ``dtype`` on ``device``."""

    config: ModelConfig
    weights: dict[str, "torch.Tensor | BlockWeight"]  # BlockWeight: a GGUF matrix kept as stored
    tokenizer: Tokenizer
    source: str  # the file or directory the weights came from


QUANTIZATIONS = (None, "none", "gguf", "auto")


def resolve_quantization(path: Path, device: str | torch.device, quantization: str | None) -> str | None:
    """"auto" (the default): a GGUF file runs on its stored blocks where the block kernels run
    (on the CPU, every instruction set quickdraft builds for: ``quickdraft check`` names it), else
    on its weights dequantized to the dtype once, at load. "none" or None: dequantized. "gguf":
    the blocks, and where the device has no block kernels (CUDA, or a CPU whose kernels did not
    build) dequantized once at load as well, with one warning line: never at every call."""
    kernels = torch.device(device).type == "cpu" and block_linear() is not None
    if quantization == "auto":
        return "gguf" if not path.is_dir() and kernels else None
    if quantization == "gguf" and not path.is_dir() and not kernels:
        why = "the CPU kernels did not build" if torch.device(device).type == "cpu" else "they run on the CPU only"
        warnings.warn(f"quickdraft: no GGUF block kernels on {torch.device(device)} ({why}): {path.name}'s blocks "
                      "are dequantized once at load, to the model's dtype", stacklevel=3)
        return None
    return None if quantization == "none" else quantization


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               quantization: str | None = "auto", requantize: str | None = None) -> LoadedModel:
    """Load a built-in model by name (``smollm2-135m-instruct``), a ``.gguf`` file, or a Hugging
    Face directory. Every tensor, norms and biases included, is in ``dtype``: upcasting is the
    decoder's decision. ``quantization="gguf"``: a GGUF's block-quantized matrices stay as stored
    (models/ggml.py), and ``dtype`` is that of the activations and of everything else; "auto"
    (the default) does so where the CPU kernels run (``resolve_quantization``); "none": dequantized.
    ``requantize`` (a GGUF block format, "Q4_0"): every matrix stored in more bits a weight is
    quantized again into it (a draft's fewer bytes a step); a GGUF's result is cached as its own
    conversion, so that a later load reads only the requantized weights."""
    if quantization not in QUANTIZATIONS:
        raise ModelFormatError(f"quantization {quantization!r} is not supported (supported: auto, none, gguf)")
    if dtype not in _DTYPES:
        raise ModelFormatError(f"dtype {dtype} is not supported (supported: {', '.join(_DTYPES.values())})")
    name_or_path = str(name_or_path)
    if registry.is_builtin(name_or_path):
        path = registry.model_path(name_or_path)
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise registry.unknown_model_error(name_or_path)
    quantization = resolve_quantization(path, device, quantization)
    if path.is_dir():
        if quantization == "gguf":
            raise ModelFormatError(f"{path}: quantization gguf needs a .gguf file, not a Hugging Face directory")
        config, weights, tokenizer = hf_loader.load_hf_dir(path, dtype, device)
        if requantize:
            weights = requantize_wider(weights, requantize)
    else:
        config, weights, tokenizer = load_gguf_cached(path, dtype, keep_blocks=quantization == "gguf",
                                                      requantize=requantize)
        weights = {k: v.to(device) for k, v in weights.items()}  # BlockWeight.to moves its parts
    if torch.device(device).type == "cpu":
        weights = into_huge_pages(weights)
    if registry.is_builtin(name_or_path):
        config = dataclasses.replace(config, name=name_or_path)
    return LoadedModel(config, weights, tokenizer, str(path))


def cached_blocks(model: LoadedModel, tag: str, build: Callable[[], dict[str, BlockWeight]]) -> dict[str, BlockWeight]:
    """The block weights ``build`` makes from ``model``, kept beside the model's conversion as
    ``<tag>.safetensors`` so that a later load reads them instead of making them again (``tag``
    must name everything they depend on besides the file). A damaged file is made again; a model
    that did not come from a GGUF file is not cached."""
    source = Path(model.source)
    if source.suffix != ".gguf" or not source.is_file():
        return build()
    file = conversion_dir(source) / f"{tag}.safetensors"
    if file.exists():
        try:
            with safe_open(file, "pt") as f:
                kinds = json.loads((f.metadata() or {})["blocks"])
            read = read_safetensors(file)
            tensors = read[0] if read is not None else load_file(file)
            return {n: BlockWeight.from_parts(kind, n, tensors) for n, kind in kinds.items()}
        except (OSError, ValueError, TypeError, KeyError, SafetensorError):
            pass
    made = build()
    flat = {k: t.cpu() for n, w in made.items() for k, t in w.parts(n).items()}
    meta = {"format": "pt", "blocks": json.dumps({n: w.ggml_type for n, w in made.items()})}
    file.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(file, lambda p: save_file(flat, str(p), metadata=meta))
    return made


def select_rows(model: LoadedModel, name: str, rows: torch.Tensor) -> BlockWeight:
    """``model.weights[name].select(rows)``, cached (``cached_blocks``): repacking a truncated
    draft head (65536 of 151936 rows) takes about 0.8 s, which every load with a draft would
    otherwise pay."""
    w = model.weights[name]
    tag = f"rows-{name}-{w.ggml_type}-{ids_key(rows)}"
    return cached_blocks(model, tag, lambda: {name: w.select(rows)})[name].to(w.device)


def ids_key(ids: torch.Tensor) -> str:
    """A short key for a list of ids (a cache file's name)."""
    return hashlib.sha256(ids.cpu().to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def fingerprint(path: Path) -> str:
    """A cheap content key: sha256 of the size, the converter version, ModelConfig's fields and
    three 1 MiB samples of the file.

    Hashing a whole 1 GB file would cost more than the cache saves on the hot path; any
    re-download, re-quantization or truncation changes the header, the size or the tail. Built-in
    models are moreover verified by their full sha256 before they get here.
    """
    size = path.stat().st_size
    # ModelConfig's field names are part of the key: a cached config.json of another shape
    # would not load into the current dataclass.
    fields = ",".join(f.name for f in dataclasses.fields(ModelConfig))
    h = hashlib.sha256(f"{size}:{CONVERTER_VERSION}:{fields}".encode())
    with open(path, "rb") as f:
        for offset in (0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)):
            f.seek(offset)
            h.update(f.read(_SAMPLE))
    return h.hexdigest()[:20]


def conversion_dir(path: Path) -> Path:
    return registry.cache_dir() / "converted" / f"{path.stem}-{fingerprint(path)}"


def load_gguf_cached(path: str | Path, dtype: torch.dtype = torch.float32, keep_blocks: bool = False,
                     requantize: str | None = None):
    """(config, weights on the CPU in ``dtype``, tokenizer) of a GGUF file, converting it once.
    With ``keep_blocks`` the cache holds the repacked block weights (about the file's size);
    ``requantize`` (a block format) is made from that entry and cached beside it."""
    path = Path(path)
    out = conversion_dir(path)
    tag = ("-blocks" if keep_blocks else "") + (f"-{requantize.lower()}" if requantize else "")
    weights_file = out / f"weights-{_DTYPES[dtype]}{tag}.safetensors"
    if all(f.exists() for f in (weights_file, out / "config.json", out / "tokenizer.json")):
        try:
            return _read_cached(out, weights_file)
        except (OSError, ValueError, TypeError, KeyError, SafetensorError):
            pass  # a damaged entry: convert again and overwrite it
    if requantize:
        config, weights, tokenizer = load_gguf_cached(path, dtype, keep_blocks)
        weights = requantize_wider(weights, requantize)
    else:
        config, weights, tokenizer = gguf_loader.load_gguf(path, dtype, keep_blocks=keep_blocks)
    _write(out, weights_file, config, weights, tokenizer)
    return config, weights, tokenizer


def _read_cached(out: Path, weights_file: Path):
    config = ModelConfig(**_config_fields(json.loads((out / "config.json").read_text())))
    tokenizer = Tokenizer.from_json((out / "tokenizer.json").read_text(encoding="utf-8"))
    with safe_open(weights_file, "pt") as f:
        blocks = json.loads((f.metadata() or {}).get("blocks", "{}"))  # name -> GGUF type
    read = read_safetensors(weights_file)  # straight into huge pages (models/memory.py)
    tensors = read[0] if read is not None else load_file(weights_file)
    weights = {n: BlockWeight.from_parts(kind, n, tensors) for n, kind in blocks.items()}
    weights |= {n: t for n, t in tensors.items() if "::" not in n}
    return config, weights, tokenizer


def _config_fields(d: dict) -> dict:
    """ModelConfig's fields from its JSON (dataclasses.asdict): lists back to tuples, rotary
    scalings back to RopeScaling, so that the config is the one the conversion read, and hashable."""
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    d["layer_types"] = tuple(d["layer_types"])
    for key in ("rope_scaling", "local_rope_scaling"):
        if d[key] is not None:
            d[key] = RopeScaling(**(d[key] | {"freq_factors": tuple(d[key]["freq_factors"])}))
    return d


def _atomic_write(target: Path, write) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _write(out: Path, weights_file: Path, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # Weights first: the loader only trusts an entry once config and tokenizer exist too.
    blocks = {n: w.ggml_type for n, w in weights.items() if isinstance(w, BlockWeight)}
    flat = {}
    for n, w in weights.items():
        flat |= w.parts(n) if isinstance(w, BlockWeight) else {n: w}
    meta = {"format": "pt", "blocks": json.dumps(blocks)}
    _atomic_write(weights_file, lambda p: save_file(flat, str(p), metadata=meta))
    _atomic_write(out / "tokenizer.json", lambda p: p.write_text(tokenizer.to_json(), encoding="utf-8"))
    _atomic_write(out / "config.json", lambda p: p.write_text(json.dumps(dataclasses.asdict(config), indent=1)))
