"""Only `kvstrata.integrations.sglang` imports sglang (checked on the source, in the main environment)."""

import ast
from pathlib import Path

import kvstrata

ROOT = Path(kvstrata.__file__).parent
PLUGIN = ROOT / "integrations" / "sglang"


def sglang_imports(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        if any(n == "sglang" or n.startswith("sglang.") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_the_plugin_imports_sglang():
    offenders = {
        str(p.relative_to(ROOT)): lines
        for p in ROOT.rglob("*.py")
        if PLUGIN not in p.parents and (lines := sglang_imports(p))
    }
    assert offenders == {}
    assert sglang_imports(PLUGIN / "pool.py")  # the check does see the plugin's own imports
