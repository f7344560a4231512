"""bench/gpu_suite.py, the plan of a device session: its jobs name commands of today (each bench's own flags, a
TRL layout that passes the scenario's --dry-run, -k expressions that select GPU tests, every GPU test
selected once), and its runner runs the lanes side by side, the benches after them, ends whatever a job started,
and on a second start runs only what has not passed; ``start`` and ``wait`` as a device session calls them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_bench_records import FLAG

from conftest import process_running, scenario_mains
from vime.devtools.make_tiny_model import make_tiny_model
from vime.devtools.shared_data import shared_data

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import gpu_suite as suite  # noqa: E402

PLANS = {gib: suite.plan(gib, Path("/data"), Path("/run"), Path("/old-tree")) for gib in (80, 141)}


@pytest.mark.parametrize("gib", sorted(PLANS))
def test_every_bench_job_names_only_its_scripts_flags(gib):
    for job in PLANS[gib]:
        if job.argv[0].startswith("bench/"):
            own = job.argv[:job.argv.index("--")] if "--" in job.argv else job.argv
            source = (ROOT / job.argv[0]).read_text()
            assert not [flag for flag in own if FLAG.fullmatch(flag) and f'"{flag}"' not in source], job


@pytest.fixture(scope="module")
def trl_dry_runs(tmp_path_factory) -> dict[float, tuple[int, str]]:
    """What e2e.py hands the scenario on each card (its flags after ``--``, a tiny model in place of the 0.6B
    one), with the ``--steps``/``--max-staleness``/``--out`` e2e.py adds, run with ``--dry-run``."""
    data = shared_data()
    if not (data / "gsm8k" / "train.jsonl").is_file() or not (data / "qwen3-tokenizer").is_dir():
        pytest.skip(f"the shared data folder ({data}) with GSM8K and the Qwen3 tokenizer is absent here")
    folder = tmp_path_factory.mktemp("trl")
    model = make_tiny_model("qwen3", data / "qwen3-tokenizer", folder / "model", seed=0)  # for the real m06
    argvs = []
    for gib, jobs in PLANS.items():
        (job,) = [job for job in jobs if job.name == "e2e-trl"]
        scenario = job.argv[job.argv.index("--") + 1:]
        argvs.append(["qwen3_4b_gsm8k", *[str(model) if scenario[at - 1] == "--model-path"
                                          else arg.replace("/data", str(data)) for at, arg in enumerate(scenario)],
                      "--steps", "7", "--max-staleness", "0", "--out", str(folder / f"run-{gib}"), "--dry-run"])
    return dict(zip(PLANS, scenario_mains(argvs, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})))


@pytest.mark.parametrize("gib", sorted(PLANS))
def test_the_trl_layout_of_each_card_passes_the_scenarios_dry_run(gib, trl_dry_runs):
    code, said = trl_dry_runs[gib]
    assert code == 0, said[-3000:]


def test_the_test_jobs_select_every_gpu_test_and_each_selects_some():
    """One collection of the GPU tests of every file that has them; each job's ``-k`` (``a or b``, ``a and b``:
    substrings of the test's id, as pytest matches them) must select some, and the jobs all of them."""
    files = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in path.read_text())
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p",
                             "no:cacheprovider", "-m", "gpu", *files], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    collected = {line for line in listed.stdout.splitlines() if "::" in line}
    assert collected, listed.stdout[-3000:] + listed.stderr[-3000:]
    for gib, jobs in PLANS.items():
        selected: list[str] = []
        for job in jobs:
            if job.argv[:2] == ["-m", "pytest"]:
                chosen = [test for test in collected if test.split("::")[0] in job.argv and _matches(job, test)]
                assert chosen, (gib, job.name)
                selected += chosen
        assert sorted(collected - set(selected)) == [], gib  # every GPU test runs
        assert len(selected) == len(set(selected)), gib  # and once: two jobs at once would run it twice


def _matches(job, test: str) -> bool:
    """Whether ``-k``, in the two forms the suite uses, selects the test id ``test``."""
    if "-k" not in job.argv:
        return True
    expression = job.argv[job.argv.index("-k") + 1]
    assert re.fullmatch(r"\w+( (and|or) \w+)*", expression) and not (" and " in expression and " or " in expression)
    words = re.split(r" (?:and|or) ", expression)
    found = [word.lower() in test.lower() for word in words]
    return all(found) if " and " in expression else any(found)


def _step(name: str, lane: str, code: str, timeout_s: int = 60):
    return suite.Job(name, lane, ["-c", code], timeout_s)


def test_the_runner_runs_lanes_side_by_side_then_the_benches_kills_at_the_limit_and_reruns_only_failures(tmp_path):
    """Whatever a job started ends with it, in a session of its own too; a bench that exits 0 with a part that
    failed has not passed; a job whose prerequisite has not passed is skipped."""
    run = tmp_path / "run"
    escaped, hung = tmp_path / "escaped.pid", tmp_path / "hung.pid"
    stamp = "import time, pathlib; pathlib.Path({!r}).write_text(str(time.time())); "
    start_sleep = ("import pathlib, subprocess; pathlib.Path({!r}).write_text(str(subprocess.Popen(['sleep', '600'], "
                   "start_new_session={}).pid)); ")
    jobs = [
        _step("passes", "a", stamp.format(str(tmp_path / "passes")) + "time.sleep(1)"),
        _step("fails", "a", "import sys; sys.exit(3)"),
        _step("hangs", "b", start_sleep.format(str(hung), False) + "import time; time.sleep(600)", timeout_s=2),
        _step("bench", suite.BENCH_LANE, stamp.format(str(tmp_path / "bench"))
              + start_sleep.format(str(escaped), True)),
        _step("bench-parts-failed", suite.BENCH_LANE, "import json, pathlib; "
              f"pathlib.Path({str(run / 'results' / 'bench-parts-failed.json')!r}).write_text(json.dumps("
              "{'rows': [{'shape': '4b', 'error': 'CUDA out of memory'}, {'shape': '0.6b', 'vime_error': ''}, "
              "{'settings': 'trl', 'complete': False, 'exit_code': 0}]}))"),
        suite.Job("bench-after-a-failure", suite.BENCH_LANE, ["-c", "pass"], 60, needs="fails"),
    ]
    started = time.monotonic()
    suite.run_jobs(jobs, run, dict(os.environ))
    assert time.monotonic() - started < 30
    rows = {row["name"]: row for row in suite.outcomes(jobs, run)}
    assert {name: (row["state"], row.get("rc"), row.get("failed_parts")) for name, row in rows.items()} == {
        "passes": ("ended", 0, 0), "fails": ("ended", 3, 0), "hangs": ("killed at its 2 s limit", -9, 0),
        "bench": ("ended", 0, 0), "bench-parts-failed": ("ended", 0, 2),
        "bench-after-a-failure": ("skipped: fails has not passed", None, None)}
    assert rows["hangs"]["started"] < rows["passes"]["started"] + rows["passes"]["seconds"]  # side by side
    assert float((tmp_path / "bench").read_text()) >= rows["hangs"]["started"] + 2  # after every lane
    assert not process_running(int(hung.read_text())) and not process_running(int(escaped.read_text()))
    assert json.loads((run / "suite.json").read_text())["jobs"][0]["name"] == "passes"
    first = (tmp_path / "passes").read_text()
    suite.run_jobs(jobs, run, dict(os.environ))
    assert (tmp_path / "passes").read_text() == first  # a job that passed is not run again
    again = {row["name"]: row for row in suite.outcomes(jobs, run)}
    assert [name for name in again if again[name].get("started") != rows[name].get("started")] == [
        "fails", "hangs", "bench-parts-failed"]  # what had not passed, and only that


def test_start_and_wait_on_a_fresh_folder_follow_the_run_to_its_end_and_pack_it(tmp_path):
    """The command line as a device session uses it: ``start`` returns at once, ``wait`` follows the detached
    runner to its end and packs the table. The job chosen brings the job that makes its model; that one fails
    here (no GPU), so the chosen one is skipped."""
    import tarfile

    run = tmp_path / "run"
    command = [sys.executable, str(ROOT / "bench" / "gpu_suite.py")]
    started = subprocess.run([*command, "start", "--out", str(run), "--data-dir", str(tmp_path), "--gib", "80",
                              "--jobs", "e2e-trl"], capture_output=True, text=True, timeout=60)
    assert started.returncode == 0 and "2 jobs" in started.stdout, started.stderr
    waited = subprocess.run([*command, "wait", "--out", str(run), "--seconds", "240", "--pack",
                             str(tmp_path / "suite.tgz")], capture_output=True, text=True, timeout=300)
    assert waited.returncode == 0 and "the suite has ended" in waited.stdout, waited.stdout + waited.stderr
    assert "skipped: model-0.6b has not passed" in waited.stdout
    with tarfile.open(tmp_path / "suite.tgz") as archive:
        table = json.load(archive.extractfile("suite.json"))
    assert [(job["name"], job["state"], job.get("rc") != 0) for job in table["jobs"]] == [
        ("model-0.6b", "ended", True), ("e2e-trl", "skipped: model-0.6b has not passed", True)]
    again = subprocess.run([*command, "plan", "--out", str(run), "--data-dir", str(tmp_path), "--jobs", "nothing",
                            "--gib", "80"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "--jobs ['nothing']: not in this card's plan" in again.stderr
