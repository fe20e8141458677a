"""The SGLang plugin tests run in ``.venv-sglang`` (``make test`` runs them there); the main
environment has no sglang, so it does not collect them."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("sglang") else ["sglang"]
