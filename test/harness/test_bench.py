"""harness.bench: the steady rate without a round's start and drain; the summary of served rounds."""

import itertools
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.bench import steady_rate, summarize_rounds


def served_at(rate, sizes, start=0.0):
    """A server answering requests back to back at `rate` tokens/s, from `start`."""
    return [(start + done / rate, n) for done, n in zip(itertools.accumulate(sizes), sizes)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rate=st.floats(10, 1e6), sizes=st.lists(st.integers(1, 8192), min_size=20, max_size=300),
       start=st.floats(0, 100), seed=st.integers(0, 2**16))
def test_a_server_at_a_constant_rate_is_measured_at_that_rate_in_any_answer_order(rate, sizes, start, seed):
    answers = served_at(rate, sizes, start)
    random.Random(seed).shuffle(answers)
    assert steady_rate(answers) == pytest.approx(rate, rel=1e-6)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rate=st.floats(100, 1e5), n=st.integers(40, 300), size=st.integers(1, 4096),
       first=st.floats(0, 30), last=st.floats(0, 30))
def test_a_slow_start_and_a_late_drain_do_not_change_it_but_lower_the_round_rate(rate, n, size, first, last):
    """The first answer comes `first` s after the round starts (the pipeline fills) and the last
    5% `last` s late (the final batch's write): the steady rate stays the server's, while
    tokens / wall drops."""
    answers = served_at(rate, [size] * n, start=first)
    tail = n - max(1, n // 20)
    answers = [(t + last if k >= tail else t, m) for k, (t, m) in enumerate(answers)]
    assert steady_rate(answers) == pytest.approx(rate, rel=1e-6)
    wall = max(t for t, _ in answers)
    assert size * n / wall <= rate


def test_too_few_answers_to_span_a_window_give_none():
    assert steady_rate([(1.0, 10), (2.0, 10)]) is None
    assert steady_rate([(1.0, 10)] * 30) is None  # all at one moment: no time to divide by


round_values = st.fixed_dictionaries({"output_tokens_per_s": st.floats(1, 1e5), "accept_length_mean": st.floats(1, 8)})


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rounds=st.integers(1, 6).flatmap(lambda n: st.tuples(st.lists(round_values, min_size=n, max_size=n),
                                                             st.lists(st.floats(1, 1e5), min_size=n, max_size=n))))
def test_every_round_counts_and_ratios_pair_rounds_by_index(rounds):
    """Acceptance and speed are summarized over all rounds (e2e_eagle3 once kept round 0's
    acceptance only), and each round's ratio is to the target alone in that same round."""
    drafted, base_rates = rounds
    base = [{"output_tokens_per_s": x, "accept_length_mean": None} for x in base_rates]
    s = summarize_rounds({"target-only": base, "draft": drafted}, "target-only")
    accept = [r["accept_length_mean"] for r in drafted]
    assert s["draft"]["accept_length_mean"]["rounds"] == accept
    assert s["draft"]["accept_length_mean"]["median"] == statistics.median(accept)
    ratios = [r["output_tokens_per_s"] / b for r, b in zip(drafted, base_rates)]
    assert s["draft"]["speedup_vs_target-only"]["rounds"] == pytest.approx(ratios)
    assert s["draft"]["speedup_vs_target-only"]["min"] == pytest.approx(min(ratios))
    assert "accept_length_mean" not in s["target-only"] and "speedup_vs_target-only" not in s["target-only"]


def test_a_server_that_lost_rounds_gets_no_ratio_it_could_not_pair():
    base = [{"output_tokens_per_s": 100.0}, {"output_tokens_per_s": 50.0}]
    s = summarize_rounds({"target-only": base, "draft": [{"output_tokens_per_s": 80.0}], "down": []}, "target-only")
    assert "speedup_vs_target-only" not in s["draft"] and "down" not in s
    assert s["draft"]["output_tokens_per_s"]["median"] == 80.0
