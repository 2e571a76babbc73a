"""serve-cpu's settings for parallelism: the ranks (TP x DP) as the launcher reads them, and the
cores each rank's threads are bound to."""

from hypothesis import given
from hypothesis import strategies as st

from sglang_hs.tools.serve import cpu_env, ranks_of, threads_bind


def test_ranks_as_the_launcher_spells_them():
    assert ranks_of(["--model-path", "m"]) == 1
    assert ranks_of(["--tp-size", "2"]) == 2
    assert ranks_of(["--tensor-parallel-size=4"]) == 4
    assert ranks_of(["--tp-size", "2", "--dp-size=2"]) == 4 == ranks_of(["--data-parallel-size", "4"])


@given(tp=st.integers(1, 9), cpus=st.sets(st.integers(0, 255), min_size=1, max_size=64))
def test_every_rank_gets_cores_and_no_core_is_given_twice_when_there_are_enough(tp, cpus):
    groups = [set(map(int, g.split(","))) for g in threads_bind(tp, cpus).split("|")]
    assert len(groups) == tp and all(groups) and set().union(*groups) <= cpus
    if len(cpus) >= tp:
        assert set().union(*groups) == cpus and sum(map(len, groups)) == len(cpus)


def test_the_user_s_own_binding_wins():
    env = cpu_env({"SGLANG_CPU_OMP_THREADS_BIND": "0-3|4-7"}, ranks=2)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0-3|4-7" and "OMP_NUM_THREADS" in env
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in cpu_env({}, ranks=1)


@given(before=st.integers(0, 80), after=st.integers(0, 300), n=st.integers(5, 60))
def test_a_start_up_failure_shows_the_first_traceback_and_the_end_of_the_log(tmp_path_factory, before, after, n):
    """A scheduler's crash is followed by the other processes' errors as the server stops; the
    tail alone showed only those (a CI failure whose cause was cut off)."""
    from sglang_hs.tools.serve import LocalServer

    lines = [f"start {i}\n" for i in range(before)] + ["Traceback (most recent call last):\n", "  the crash\n"] + \
        [f"later {i}\n" for i in range(after)]
    path = tmp_path_factory.mktemp("log") / "server.log"
    path.write_text("".join(lines))
    out = LocalServer(["--model-path", "m"], str(path)).log_tail(n).splitlines(keepends=True)
    assert "Traceback (most recent call last):\n" in out and "  the crash\n" in out
    assert out[-min(n, len(lines)):] == lines[-n:]
    assert len(out) <= n + 41 and len(set(l for l in out if l.startswith(("start", "later")))) == \
        len([l for l in out if l.startswith(("start", "later"))])  # no line twice
