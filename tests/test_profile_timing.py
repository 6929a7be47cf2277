"""How the hardware profile times its speeds: what a run a minute long sustains on a host
whose speed swings, not its fastest moment (planner/hardware_profile._timed, _sustained_rates)."""

from types import SimpleNamespace

import pytest

from flexgen_helm.planner import hardware_profile


@pytest.fixture
def clock(monkeypatch):
    """A fake perf_counter, and a machine whose speed is slowdown(now) (1: full speed)."""
    state = SimpleNamespace(now=0.0, slowdown=lambda now: 1.0)
    monkeypatch.setattr(hardware_profile, "time", SimpleNamespace(perf_counter=lambda: state.now))

    def work(seconds):
        def run():
            state.now += seconds * state.slowdown(state.now)
        return run
    state.work = work
    return state


def test_a_call_time_is_the_mean_of_the_window_not_its_fastest_call(clock):
    clock.slowdown = lambda now: 1.0 if int(now / 0.05) % 2 == 0 else 3.0  # alternating spells
    seconds = hardware_profile._timed(clock.work(0.01))
    assert 0.015 < seconds < 0.025  # half the calls at 0.01 s, half at 0.03 s: the fastest would be 0.01


def test_a_table_timed_in_rounds_keeps_its_shape_through_a_slow_spell(clock):
    """Two jobs of the same speed get the same rate when the machine slows down halfway
    through: timed one after the other, the second would read 3x slower."""
    clock.slowdown = lambda now: 1.0 if now < 1.0 else 3.0
    rates = hardware_profile._sustained_rates({"a": (clock.work(0.01), 1.0), "b": (clock.work(0.01), 1.0)}, 2.0)
    assert rates["a"] == pytest.approx(rates["b"], rel=0.05)
    assert rates["a"] < 70  # the slow spell counts (~66 calls/s): not the fastest call's 100


def test_overlap_loss_tells_work_that_overlaps_from_work_that_takes_turns():
    """The profile's disk overlap loss (hardware_profile.overlap_loss): near 0 where the reads
    hide behind compute (both wait, as a disk read and a GPU would), near 1 where the two take
    turns (both hold one lock, as two jobs on the same busy cores would)."""
    import threading
    import time

    from flexgen_helm.planner.hardware_profile import overlap_loss

    def sleeps(n: int) -> None:
        for _ in range(n):
            time.sleep(0.002)

    turns = threading.Lock()

    def taking_turns(n: int) -> None:
        for _ in range(n):
            with turns:
                time.sleep(0.002)

    assert overlap_loss(sleeps, sleeps, 0.1) < 0.3
    assert overlap_loss(taking_turns, taking_turns, 0.1) > 0.7
