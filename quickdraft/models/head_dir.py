"""A trained head's directory (EAGLE-3, Medusa): ``config.json`` and safetensors weights, as the
field's tools write them, each file written atomically so that a reader never sees half a file."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quickdraft.errors import ConfigError


def save(path: str | Path, state: dict[str, torch.Tensor], config: dict) -> Path:
    """``state`` (floating tensors as float32) into model.safetensors and ``config`` into config.json."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / ".model.safetensors.tmp"
    save_file({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, str(tmp))
    tmp.replace(path / "model.safetensors")
    tmp = path / ".config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(path / "config.json")
    return path


def load(path: str | Path, what: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, the weights of every *.safetensors file, else of pytorch_model.bin) of
    ``path``; ``what`` names the head in the errors ("an EAGLE-3 head", "Medusa heads")."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        doc = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}/config.json cannot be read as the config of {what}: {e}") from None
    files = sorted(path.glob("*.safetensors"))
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    if not files and (path / "pytorch_model.bin").is_file():
        # EAGLE's published heads (EAGLE3-LLaMA3.1-Instruct-8B): a torch pickle, read as tensors only
        try:
            weights = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure: a file that is not plain tensors
            raise ConfigError(f"{path}/pytorch_model.bin cannot be read as tensors: {e}") from None
    elif not files:
        raise ConfigError(f"{path} holds no *.safetensors (or pytorch_model.bin) weights")
    return doc, weights
