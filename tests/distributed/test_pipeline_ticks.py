"""The schedules' tick arithmetic (``stackwise/_pipeline/ticks.py``): which microbatch and
which round each stage runs at each tick, against tables written out by hand from each
schedule's definition, and the dependencies every schedule must respect, for many
(S, M, V). Plain integers: no devices."""

from __future__ import annotations

import itertools

import pytest

from stackwise._pipeline import ticks


def _forward(order, S, M, V, T):
    """Per stage, per tick: ``"m/r"`` of the forward step it runs, ``"."`` for a bubble."""
    rows = []
    for s in range(S):
        row = []
        for t in range(T):
            k = ticks.forward_step(t, s)
            row.append("{}/{}".format(*order(k)) if ticks.is_step(k, M, V) else ".")
        rows.append(" ".join(row))
    return rows


def _backward(S, M, V, T):
    """Per stage, per tick: ``"m/r"`` of the backward step it runs (1F1B), rounds down."""
    rows = []
    for s in range(S):
        row = []
        for t in range(T):
            k = ticks.backward_step(t, s, S, V)
            m, r = ticks.interleaved_order(k, S, V)
            row.append(f"{m}/{V - 1 - r}" if ticks.is_step(k, M, V) else ".")
        rows.append(" ".join(row))
    return rows


def test_gpipe_table():
    """S=3, M=4: microbatch m enters stage 0 at tick m and moves one stage a tick."""
    S, M, V = 3, 4, 1
    T = ticks.gpipe_ticks(S, M, V)
    assert T == 6
    assert _forward(lambda k: ticks.circular_order(k, M), S, M, V, T) == [
        "0/0 1/0 2/0 3/0 . .",
        ". 0/0 1/0 2/0 3/0 .",
        ". . 0/0 1/0 2/0 3/0",
    ]


def test_circular_table():
    """S=2, M=3, V=2: every microbatch goes once round the ring before any goes twice;
    what leaves stage 1 is back at stage 0 two ticks after it entered."""
    S, M, V = 2, 3, 2
    T = ticks.gpipe_ticks(S, M, V)
    assert T == 7
    assert _forward(lambda k: ticks.circular_order(k, M), S, M, V, T) == [
        "0/0 1/0 2/0 0/1 1/1 2/1 .",
        ". 0/0 1/0 2/0 0/1 1/1 2/1",
    ]
    returned = []
    for t in range(T):
        k = ticks.returned_step(t, S)
        m, r = ticks.circular_order(k, M)
        returned.append(f"{m}/{r}" if ticks.is_step(k, M, V) else ".")
    assert " ".join(returned) == ". . 0/0 1/0 2/0 0/1 1/1"


def test_1f1b_table():
    """S=3, M=4: stage s runs the forward of microbatch t - s and the backward of
    t - (2S - 2 - s); the last stage a microbatch's forward and backward in one tick."""
    S, M, V = 3, 4, 1
    T = ticks.one_f_one_b_ticks(S, M, V)
    assert T == 8
    assert _forward(lambda k: ticks.interleaved_order(k, S, V), S, M, V, T) == [
        "0/0 1/0 2/0 3/0 . . . .",
        ". 0/0 1/0 2/0 3/0 . . .",
        ". . 0/0 1/0 2/0 3/0 . .",
    ]
    assert _backward(S, M, V, T) == [
        ". . . . 0/0 1/0 2/0 3/0",
        ". . . 0/0 1/0 2/0 3/0 .",
        ". . 0/0 1/0 2/0 3/0 . .",
    ]
    assert ticks.one_f_one_b_phases(S, M, V) == [
        (0, 2, True, False), (2, 6, True, True), (6, 8, False, True),
    ]  # fmt: skip
    assert ticks.ring_slots(S, M, V) == 4


def test_interleaved_1f1b_table():
    """S=2, V=2, M=4, Megatron's order: microbatches in groups of S=2, each group round the
    ring twice (chunk r*S + s on stage s); the backward runs the rounds down, chunk 3 first."""
    S, M, V = 2, 4, 2
    T = ticks.one_f_one_b_ticks(S, M, V)
    assert T == 12
    assert _forward(lambda k: ticks.interleaved_order(k, S, V), S, M, V, T) == [
        "0/0 1/0 0/1 1/1 2/0 3/0 2/1 3/1 . . . .",
        ". 0/0 1/0 0/1 1/1 2/0 3/0 2/1 3/1 . . .",
    ]
    assert _backward(S, M, V, T) == [
        ". . . . 0/1 1/1 0/0 1/0 2/1 3/1 2/0 3/0",
        ". . . 0/1 1/1 0/0 1/0 2/1 3/1 2/0 3/0 .",
    ]
    assert ticks.one_f_one_b_phases(S, M, V) == [
        (0, 3, True, False), (3, 9, True, True), (9, 12, False, True),
    ]  # fmt: skip
    assert ticks.ring_slots(S, M, V) == 7


_GRID = [
    (S, M, V)
    for S, M, V in itertools.product(range(1, 5), range(1, 9), range(1, 4))
    if V == 1 or S >= 2
]


def _when(S, M, V, order, count, step_of):
    """``{(s, m, r): tick}`` of every step a stage runs, by ``step_of(t, s)``."""
    out = {}
    for s, t in itertools.product(range(S), range(count)):
        k = step_of(t, s)
        if ticks.is_step(k, M, V):
            out[(s, *order(k))] = t
    return out


@pytest.mark.parametrize("S, M, V", [c for c in _GRID if c[1] >= c[0] or c[2] == 1])
def test_circular_dependencies(S, M, V):
    """Every (microbatch, round) runs once on every stage, one tick after the stage
    before, and a round after the first only once the last one came back round the ring."""
    T = ticks.gpipe_ticks(S, M, V)
    at = _when(S, M, V, lambda k: ticks.circular_order(k, M), T, ticks.forward_step)
    assert len(at) == S * M * V
    back = {
        ticks.circular_order(ticks.returned_step(t, S), M): t
        for t in range(T + 1) if ticks.is_step(ticks.returned_step(t, S), M, V)
    }  # fmt: skip
    for (s, m, r), t in at.items():
        if s:
            assert at[s - 1, m, r] == t - 1
        elif r:
            assert back[m, r - 1] <= t  # parked at stage 0 until its round comes up
    assert max(at.values()) == T - 1


@pytest.mark.parametrize("S, M, V", [c for c in _GRID if c[2] == 1 or c[1] % c[0] == 0])
def test_1f1b_dependencies(S, M, V):
    """Forward: one stage on per tick, round the ring with no wait. Backward: one stage
    back per tick, the last chunk's in the tick of its forward. A ring slot is not
    overwritten between a step's forward and its backward."""
    order = lambda k: ticks.interleaved_order(k, S, V)  # noqa: E731
    down = lambda k: (order(k)[0], V - 1 - order(k)[1])  # noqa: E731
    T = ticks.one_f_one_b_ticks(S, M, V)
    fwd = _when(S, M, V, order, T, ticks.forward_step)
    bwd = _when(S, M, V, down, T, lambda t, s: ticks.backward_step(t, s, S, V))
    assert len(fwd) == len(bwd) == S * M * V
    K = ticks.ring_slots(S, M, V)
    for (s, m, r), t in fwd.items():
        k = ticks.interleaved_step(m, r, S, V)
        assert ticks.interleaved_order(k, S, V) == (m, r) and fwd[s, m, r] == k + s
        if s:
            assert fwd[s - 1, m, r] == t - 1
        elif r:
            assert fwd[S - 1, m, r - 1] == t - 1
        later = bwd[s, m, r]
        if (s, r) == (S - 1, V - 1):
            assert later == t  # the loss and the first backward step in its forward's tick
        elif s < S - 1:
            assert bwd[s + 1, m, r] == later - 1
        else:
            assert bwd[0, m, r + 1] == later - 1
        # No forward writes slot k % K after this one until its backward has read it (a
        # tick's forward writes its slot before its backward reads one).
        for k2 in range(k + 1, min(ticks.forward_step(later, s) + 1, M * V)):
            assert k2 % K != k % K
    phases = ticks.one_f_one_b_phases(S, M, V)
    assert phases[0][0] == 0 and phases[-1][1] == T
    for first, stop, f, b in phases:
        for t in range(first, stop):
            assert f == any(ticks.is_step(ticks.forward_step(t, s), M, V) for s in range(S))
            assert b == any(ticks.is_step(ticks.backward_step(t, s, S, V), M, V) for s in range(S))
