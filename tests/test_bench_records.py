"""The commands recorded beside the figures in bench/results/*.json still run at HEAD (issue 36, item 8): a
figure whose command no longer parses cannot be measured again. Each ``bench/NAME.py`` command's flags must be
flags of that script (read from its ``add_argument`` calls: the scripts import torch and vLLM at the top, too
slow to load them all here); each ``-m vime.scenario`` command must pass ``--dry-run`` (its model folder and
run folder, paths of the machine it ran on, left out). And no record names a path of this machine's
checkouts."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import scenario_mains

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
BENCH = RESULTS.parent
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


def recorded_commands() -> Iterator[tuple[str, str]]:
    """Every ``command`` string in the JSON records, with the file it is in."""
    def walk(value: object) -> Iterator[str]:
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "command" and isinstance(item, str):
                    yield item
                else:
                    yield from walk(item)
        elif isinstance(value, list):
            for item in value:
                yield from walk(item)

    for path in sorted(RESULTS.glob("*.json")):
        for command in sorted(set(walk(json.loads(path.read_text())))):
            yield path.name, command


def _script_commands() -> list[tuple[str, str, str]]:
    found = []
    for record, command in recorded_commands():
        script = re.search(r"bench/(\w+\.py)|(?<![\w/])(\w+\.py)\b", command)
        if script is not None and "-m vime.scenario" not in command.split(".py")[0]:
            found.append((record, script.group(1) or script.group(2), command))
    return found


def _scenario_commands() -> dict[tuple[str, ...], tuple[str, list[str]]]:
    """The ``-m vime.scenario`` commands, one for each set of flags they use."""
    found: dict[tuple[str, ...], tuple[str, list[str]]] = {}
    for record, command in recorded_commands():
        if not command.startswith(("-m vime.scenario", "python -m vime.scenario")):
            continue
        argv = shlex.split(command.split(" (")[0])
        argv = argv[argv.index("vime.scenario") + 1:]
        found.setdefault(tuple(sorted(FLAG.findall(command))), (record, argv))
    return found


@pytest.mark.parametrize("record,script,command", _script_commands(),
                         ids=lambda value: value if isinstance(value, str) and value.endswith(".json") else "")
def test_a_recorded_bench_command_names_only_its_scripts_flags(record, script, command):
    source = (BENCH / script).read_text()
    given = FLAG.findall(command.split(" -- ")[0])  # after "--": the flags its runs pass on to vime
    unknown = sorted({flag for flag in given if f'"{flag}"' not in source})
    assert not unknown, f"{record}: {script} has no {unknown}: `{command}`"


SCENARIO_COMMANDS = list(_scenario_commands().values())


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> list[tuple[int, str]]:
    """Each recorded scenario command's ``--dry-run``: (exit code, what it said on stderr)."""
    dropped = {"--model-path", "--out"}  # a folder of the machine it ran on; --dry-run would look for it
    argvs = [[arg for at, arg in enumerate(argv) if arg not in dropped and (at == 0 or argv[at - 1] not in dropped)]
             + ["--out", str(tmp_path_factory.mktemp("dry-run") / "run"), "--dry-run"]
             for _, argv in SCENARIO_COMMANDS]
    return scenario_mains(argvs, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})  # as on the one GPU they ran on


@pytest.mark.parametrize("at", range(len(SCENARIO_COMMANDS)), ids=[record for record, _ in SCENARIO_COMMANDS])
def test_a_recorded_scenario_command_parses_at_head(at, dry_runs):
    code, said = dry_runs[at]
    assert code == 0, (SCENARIO_COMMANDS[at], said[-3000:])


def test_no_record_names_a_path_of_a_checkout():
    named = [(record, command) for record, command in recorded_commands() if re.search(r"(?<![\w.])/work/", command)]
    assert not named, named
