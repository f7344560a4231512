"""A slime user's flags on vime's command line (issue 33): no abbreviations, slime's names as aliases of the
settings that mean the same, and Megatron's derived data-parallel size."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout)


def test_every_parser_refuses_abbreviations():
    """argparse's prefix matching would read slime's --save as vime's --save-every (or say it is ambiguous): every
    parser of vime's entry points is built with allow_abbrev=False, so a flag is taken whole or not at all."""
    parsers = []
    for path in [*(ROOT / "vime").rglob("*.py"), *(ROOT / "scenarios").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser":
                parsers.append(path.relative_to(ROOT))
                keywords = {keyword.arg: keyword.value for keyword in node.keywords}
                assert "allow_abbrev" in keywords and keywords["allow_abbrev"].value is False, (
                    f"{path.relative_to(ROOT)}:{node.lineno}: pass allow_abbrev=False to ArgumentParser")
    assert len(parsers) >= 5  # scenario, actor, replay, inject, make_tiny_model


def test_an_abbreviated_flag_is_refused_by_name():
    for flag in ("--save", "--rollout-batch", "--save-hf"):
        result = run("vime.scenario", "arithmetic", flag, "3")
        assert result.returncode == 2 and f"unrecognized arguments: {flag} 3" in result.stderr, result.stderr
    result = run("vime.actor", "trainer", "--log-lev", "debug")
    assert result.returncode == 2 and "unrecognized arguments: --log-lev debug" in result.stderr, result.stderr
