"""A truncated draft vocabulary: which rows of the draft's output head it scores.

A draft's output head is one row per token; the Qwen2.5 0.5B's tied head has 151936 rows, about a
quarter of the bytes the draft reads per token. With a truncated vocabulary the draft scores only
the N most frequent tokens (the *subset*), so its proposal distribution q is zero outside it. That
stays lossless: q is what the draft really samples from, and the verifier's min(1, p/q) rule and
its recovery from max(0, p - q) make the output the target's for any q (Leviathan et al. 2023,
Algorithm 1). A token outside the subset is never proposed; the target emits it at a rejection or
as the bonus token. FR-Spec (Zhao et al. 2025) measures the same trade on frequency-ranked subsets.

Where the subset comes from: token counts over a local corpus that no benchmark prompt set is
part of, this Python's standard library sources (its docstrings and comments are the English
part) and the licence texts in /usr/share/common-licenses. Tokens the corpus never shows are
ranked by id (a BPE vocabulary is ordered by merge rank, a rough frequency order). Every added
token (control tokens such as ``<|im_start|>``), the eos ids and the bos id are always in the
subset. Counts are kept in ``$QUICKDRAFT_CACHE/draft_vocab/``, keyed by the tokenizer's content
and the corpus, and each subset beside them by N, so a machine counts once. A user may give their
own subset instead (``read_id_file``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import torch

from quickdraft.errors import ConfigError

# Bump when the corpus or the ranking changes, so that cached subsets of the old rule are not reused.
CORPUS_VERSION = 1
LICENSES = Path("/usr/share/common-licenses")
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
_FILES_PER_BATCH = 32  # files tokenized per call (the progress bar moves by these)


def corpus_files() -> list[Path]:
    """The counting corpus, sorted: the standard library's ``*.py`` (its own tests and installed
    packages left out) and the licence texts where the system has them."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # pruned, not walked: site-packages is large
        files += [Path(root) / n for n in names if n.endswith(".py")]
    if LICENSES.is_dir():
        files += [f for f in LICENSES.iterdir() if f.is_file() and not f.is_symlink()]
    return sorted(files)


def corpus_key(files: list[Path]) -> str:
    """What decides the counts besides the tokenizer: the rule's version, Python's version and the
    files' names and sizes."""
    h = hashlib.sha256(f"{CORPUS_VERSION}:{sys.version_info[:2]}".encode())
    for f in files:
        h.update(f"{f}:{f.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def tokenizer_key(tokenizer) -> str:
    """The tokenizer's identity: a hash of everything that encodes text (vocabulary, merges, added
    tokens, eos and bos)."""
    return tokenizer.fingerprint()[:16]


def count_tokens(tokenizer, files: list[Path], num_rows: int, progress: bool = True) -> np.ndarray:
    """[num_rows] int64: how often each id occurs when every file is encoded on its own."""
    from tqdm import tqdm

    counts = np.zeros(num_rows, dtype=np.int64)
    batches = [files[i : i + _FILES_PER_BATCH] for i in range(0, len(files), _FILES_PER_BATCH)]
    bar = tqdm(total=len(files), desc="counting draft vocabulary", unit="file", file=sys.stderr,
               disable=not progress, mininterval=1.0)
    for batch in batches:
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in batch]
        for ids in tokenizer.encode_batch(texts):
            counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=num_rows)[:num_rows]
        bar.update(len(batch))
    bar.close()
    return counts


def always_kept(tokenizer, config) -> list[int]:
    """Ids every subset holds: the added tokens (control and user-defined), eos and bos."""
    ids = set(config.eos_token_ids) | ({config.bos_token_id} if config.bos_token_id is not None else set())
    if tokenizer is not None:
        ids |= set(tokenizer.added_token_ids()) | set(tokenizer.eos_token_ids)
        if tokenizer.bos_token_id is not None:
            ids.add(tokenizer.bos_token_id)
    return sorted(i for i in ids if 0 <= i < config.vocab_size)


def top_ids(counts: np.ndarray, size: int, keep: list[int]) -> torch.Tensor:
    """[size] int64, ascending: ``keep`` and then the most frequent ids (ties and unseen tokens by
    lowest id) until there are ``size``."""
    if len(keep) > size:
        raise ConfigError(f"draft_vocab_size {size} is smaller than the {len(keep)} special and end-of-text "
                          "tokens every draft vocabulary keeps", "draft_vocab_size")
    order = np.argsort(-counts, kind="stable")  # most frequent first, lowest id first on ties
    chosen = set(keep)
    for i in order.tolist():
        if len(chosen) >= size:
            break
        chosen.add(i)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def frequent_ids(tokenizer, config, size: int, progress: bool = True) -> torch.Tensor:
    """The ``size`` most frequent ids of the corpus for this tokenizer (see the module docstring),
    read from the cache, or counted once and cached."""
    from quickdraft.models.registry import cache_dir

    files = corpus_files()
    root = cache_dir() / "draft_vocab"
    stem = f"{tokenizer_key(tokenizer)}-{corpus_key(files)}"
    ids_file = root / f"{stem}-top{size}.json"
    cached = _read_ids(ids_file)
    if cached is not None:
        return torch.tensor(cached, dtype=torch.long)
    counts_file = root / f"{stem}-counts.npy"
    try:
        counts = np.load(counts_file)
        if counts.shape != (config.vocab_size,):
            raise ValueError(counts_file)
    except (OSError, ValueError):
        counts = count_tokens(tokenizer, files, config.vocab_size, progress)
        _atomic_write(counts_file, lambda p: np.save(p, counts))
    ids = top_ids(counts, size, always_kept(tokenizer, config))
    covered = float(counts[ids.numpy()].sum() / max(counts.sum(), 1))
    doc = {"ids": ids.tolist(), "size": size, "corpus_tokens": int(counts.sum()), "coverage": covered,
           "corpus": f"Python {sys.version_info[0]}.{sys.version_info[1]} stdlib *.py + {LICENSES}"}
    _atomic_write(ids_file, lambda p: p.write_text(json.dumps(doc)))
    return ids


def read_id_file(path: str | os.PathLike, tokenizer, config) -> torch.Tensor:
    """A user's subset: a JSON list of ids, a JSON object with ``"ids"`` (as the cache writes), or
    text with one id per line (or separated by spaces). The ids every subset keeps are added."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"draft_vocab_file {str(path)!r} cannot be read: {e.strerror or e}", "draft_vocab_file") from None
    try:
        doc = json.loads(text)
        ids = doc["ids"] if isinstance(doc, dict) else doc
    except (json.JSONDecodeError, KeyError):
        ids = text.split()
    try:
        ids = [int(i) for i in ids]
    except (TypeError, ValueError):
        raise ConfigError(f"draft_vocab_file {str(path)!r} must hold token ids: a JSON list, or one integer a line",
                          "draft_vocab_file") from None
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise ConfigError(f"draft_vocab_file {str(path)!r} has ids outside 0..{config.vocab_size - 1}, e.g. {bad[0]}",
                          "draft_vocab_file")
    if not ids:
        raise ConfigError(f"draft_vocab_file {str(path)!r} holds no token ids", "draft_vocab_file")
    return torch.tensor(sorted(set(ids) | set(always_kept(tokenizer, config))), dtype=torch.long)


def resolve(spec, model) -> torch.Tensor | None:
    """The draft's subset for a speculative config: [N] int64 ascending ids, or None for the whole
    head (no key set, or a size that covers the whole vocabulary)."""
    if spec.draft_vocab_file is not None:
        ids = read_id_file(spec.draft_vocab_file, model.tokenizer, model.config)
    elif spec.draft_vocab_size is not None and spec.draft_vocab_size < model.config.vocab_size:
        if model.tokenizer is None:  # only a model built in code has none; the size may be the default
            warnings.warn(f"draft_vocab_size: {model.source} has no tokenizer to count token frequencies with; "
                          "the draft keeps its whole output head (give draft_vocab_file to truncate it)", stacklevel=2)
            return None
        ids = frequent_ids(model.tokenizer, model.config, spec.draft_vocab_size)
    else:
        return None
    return None if ids.numel() >= model.config.vocab_size else ids


def _read_ids(path: Path) -> list[int] | None:
    try:
        return [int(i) for i in json.loads(path.read_text())["ids"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged: count again


def _atomic_write(target: Path, write) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp{target.suffix}")  # np.save keeps a .npy name
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
