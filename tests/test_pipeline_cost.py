"""The step model's pipeline bubble against hand counts of the schedules' time slots."""

import pytest

from flashcp.costmodel.pipeline import bubble_fraction, in_flight, p2p_ms, pipeline_step


def _gpipe_slots(p: int, m: int) -> int:
    """A hand count: unit forward and backward slots, each rank running a microbatch's forward once its
    predecessor's is done and its backward once its successor's is (GPipe: all forwards, then all
    backwards); the step's length in slots."""
    fwd_end = [[0] * m for _ in range(p)]
    for r in range(p):
        free = 0
        for i in range(m):
            start = max(free, fwd_end[r - 1][i] if r else 0)
            fwd_end[r][i] = free = start + 1
    bwd_end = [[0] * m for _ in range(p)]
    free_after = [fwd_end[r][-1] for r in range(p)]
    for r in reversed(range(p)):
        free = free_after[r]
        for i in range(m):
            start = max(free, bwd_end[r + 1][i] if r < p - 1 else 0)
            bwd_end[r][i] = free = start + 1
    return max(bwd_end[0])


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 4), (4, 8), (8, 16)])
def test_the_gpipe_and_1f1b_bubble_is_the_hand_count(p, m):
    slots = _gpipe_slots(p, m)  # forward and backward slots of unit time: 2 (m + p - 1)
    assert slots == 2 * (m + p - 1)
    idle = slots - 2 * m  # per rank
    for schedule in ("GPipe", "1F1B"):
        assert bubble_fraction(schedule, p, m) == pytest.approx(idle / slots)
    step = pipeline_step("1F1B", p, m, microbatch_ms=2.0)
    assert step.total == pytest.approx(slots) and step.bubble == pytest.approx(idle)


def test_interleaved_bubble_and_sends():
    # p = 4, v = 2, m = 8: 16 chunk slots of work each way, 3 fill slots: 3 / 19
    assert bubble_fraction("Interleaved1F1B", 4, 8, v=2) == pytest.approx(3 / 19)
    step = pipeline_step("Interleaved1F1B", 4, 8, microbatch_ms=10.0, send_ms=0.5, v=2)
    assert step.work == pytest.approx(80.0) and step.bubble == pytest.approx(15.0)
    assert step.p2p == pytest.approx(2 * 19 * 0.5)
    with pytest.raises(ValueError, match="not modelled"):
        bubble_fraction("ZBVZeroBubble", 4, 8)
    # 128K tokens / CP 4 on a TP 8 rank: 32K x 16384 x 2 / 8 bytes = 128 MiB at 45 GB/s = 2.98 ms (+ 9.6 us)
    assert p2p_ms(32768, 16384, tp=8) == pytest.approx(32768 * 16384 * 2 / 8 / 45e9 * 1e3 + 0.0096)


def test_in_flight_microbatches_per_schedule():
    assert [in_flight("GPipe", 4, 8, r) for r in range(4)] == [8] * 4
    assert [in_flight("1F1B", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1F1B", 4, 2, r) for r in range(4)] == [2, 2, 2, 1]
    # torch's interleaved warmup: (v - 1) x microbatches per round + 2 (p - 1 - rank), + 1 in flight
    assert [in_flight("Interleaved1F1B", 4, 8, r, v=2) for r in range(4)] == [4 + 6 + 1, 4 + 4 + 1, 4 + 2 + 1, 4 + 1]
