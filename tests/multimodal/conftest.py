"""The engine tests' helper modules (`kernel_variants`, `graph_steps`) importable here too."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
