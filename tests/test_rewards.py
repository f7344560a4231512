"""The math rewards: GSM8K answers and general answers through math-verify, with tricky cases."""

from __future__ import annotations

import json
import threading
import time

import pytest

from vime import rewards
from vime.devtools.shared_data import shared_data

DATA = shared_data()


@pytest.mark.parametrize(("response", "label", "reward"), [
    ("Natalia sold 48+24 = 72 clips.\n#### 72", "She sold 48/2 = <<48/2=24>>24.\n#### 72", 1.0),
    ("#### 1,000", "#### 1000", 1.0),  # thousands separators
    ("The total is $1,000.00.", "1000", 1.0),  # currency sign and trailing zeros
    ("So she earned \\$10 per hour.", "#### 10", 1.0),  # a LaTeX-escaped dollar
    ("It rose by 50%.", "50", 1.0),
    ("The answer is \\boxed{\\$18}. Check: 9 + 9 = 18", "18", 1.0),
    ("We get \\boxed{7} hmm, 8 in all?", "7", 1.0),  # the boxed answer wins over the last number
    ("So each gets \\boxed{\\dfrac{15}{2}} pies", "#### 7.5", 1.0),
    ("I first thought 12, then 15 and finally 18.", "18", 1.0),  # no #### nor box: the last number
    ("It costs 18.", "18", 1.0),  # a full stop is not a decimal point
    ("The temperature fell to \u22123 degrees", "-3", 1.0),  # a typographic minus
    ("#### 18 because 3 * 6 = 18 and 20 - 2", "18", 1.0),  # after ####, the first number counts
    ("#### 17", "#### 18", 0.0),
    ("\\boxed{17} although some say 18", "18", 0.0),  # the box is the final answer
    ("I don't know", "18", 0.0),
    ("", "18", 0.0),
    ("#### ", "18", 0.0),
    ("0.5", "#### 0.50", 1.0),
    ("1.5", "15", 0.0),
])
def test_gsm8k(response: str, label: str, reward: float) -> None:
    assert rewards.gsm8k(response, label) == reward


@pytest.mark.parametrize(("response", "label", "reward"), [
    ("The answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("Step 1 ... so x = 3.\nAnswer: 34", "34", 1.0),  # DAPO's "Answer:" line, not the earlier number
    ("Answer: $\\sqrt{3}$", "\\sqrt{3}", 1.0),
    ("\\boxed{1+x^2}", "x^2+1", 1.0),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("I think 35 at first. \\boxed{34}", "34", 1.0),
    ("Answer: 35", "34", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.33", 0.0),  # not equal, only close
    ("\\boxed{x^2-1}", "x^2+1", 0.0),
    ("no answer at all", "34", 0.0),
    ("", "34", 0.0),
])
def test_math(response: str, label: str, reward: float) -> None:
    assert rewards.math(response, label) == reward


@pytest.mark.parametrize(("response", "label", "reward"), [
    ("The answer is \\boxed{9^{9^{9^{9}}}}", "81", 0.0),  # a power tower: 5 s of sympy before, math-verify's limit
    ("\\boxed{(10^{100})^{1000}}", "1", 0.0),
    ("\\boxed{9^{9^{9^{9}}}}", "9^{9^{9^{9}}}", 1.0),  # the label's own expression, as written
    ("\\boxed{2^{10}}", "1024", 1.0),  # powers of a sane size are still evaluated
    ("\\boxed{2^{-3}}", "0.125", 1.0),
])
def test_an_answer_too_large_to_evaluate_is_compared_as_written_at_once(response: str, label: str,
                                                                         reward: float) -> None:
    rewards.math("\\boxed{1}", "1")  # math-verify's first call loads sympy's parser
    started = time.perf_counter()
    assert rewards.math(response, label) == reward
    assert time.perf_counter() - started < 0.5


def test_math_outside_the_main_thread_runs_without_the_signal_timeout() -> None:
    results: list[float] = []
    worker = threading.Thread(target=lambda: results.append(rewards.math("\\boxed{\\frac{2}{4}}", "0.5")))
    worker.start()
    worker.join()
    assert results == [1.0]


def test_both_are_built_in_rewards_with_the_reward_contract() -> None:
    for name in ("gsm8k", "math"):
        assert rewards.resolve(name) is getattr(rewards, name)
        rewards.check_contract(getattr(rewards, name))


def test_gsm8k_reference_solutions_score_one_against_their_own_labels() -> None:
    path = DATA / "gsm8k" / "train.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K is not at {path} (the shared data folder is absent on this machine)")
    rows = [json.loads(line) for line in path.read_text().splitlines()[:2000]]
    misses = [row["answer"][-80:] for row in rows if rewards.gsm8k(row["answer"], row["answer"]) != 1.0]
    assert not misses, misses[:5]
    wrong = sum(rewards.gsm8k(a["answer"], b["answer"]) for a, b in zip(rows, rows[1:]))
    assert wrong < 0.05 * len(rows)  # a neighbour's solution is rarely right by accident


def test_the_report_is_titled_with_the_run_and_its_panels_with_their_quantities():
    """write_report's panel loop reused the name ``title``: the figure was titled with the last panel's
    heading ("step time (s)") instead of the run's."""
    import matplotlib.pyplot as plt

    from vime.report import PANELS, draw

    rows = [{"step": step, "raw_reward": 0.1 * step} for step in range(3)]
    figure = draw(rows, "grpo seed 3")
    try:
        assert figure._suptitle.get_text() == "grpo seed 3"
        assert [axis.get_title() for axis in figure.axes] == [heading for heading, _ in PANELS]
    finally:
        plt.close(figure)
