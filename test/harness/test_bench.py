"""harness.bench.steady_rate: the benchmark's rate without a round's start and drain."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.bench import steady_rate


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
