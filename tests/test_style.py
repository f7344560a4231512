"""The tree is lint-clean under the rules in pyproject.toml ([tool.ruff]): a new file or change that breaks them
fails here, in the test command, rather than waiting for someone to run the linter by hand."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_passes_ruff():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: bash install.sh dev installs it (the dev extra pins it)")
    found = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                           capture_output=True, text=True, cwd=ROOT)
    assert found.returncode == 0, f"ruff check found problems (fix them, or `ruff check --fix`):\n{found.stdout}"
