"""Which microbatch and which chunk each stage runs at each tick: the schedules' arithmetic.

Plain integer functions: they take Python ints (the tests' tables, tests/distributed/
test_pipeline_ticks.py) and traced integer arrays (the device programs) alike.

Stage s of S holds V chunks of layers, chunk ``r*S + s`` being its round r (V = 1 for
GPipe and plain 1F1B). Every stage runs its M*V *steps* k = 0, 1, ..., one per tick,
stage s running forward step ``t - s`` at tick t (:func:`forward_step`): a microbatch's
activations go one stage on per tick. A step is a microbatch m on the stage's chunk of
round r, in the schedule's order:

* GPipe and circular (:func:`circular_order`): every microbatch goes once round the ring
  before any goes twice: step k is microbatch ``k % M`` in round ``k // M``. What leaves
  the last stage comes back to stage 0 S ticks after it entered (:func:`returned_step`)
  and waits there for its next round.
* 1F1B, interleaved with V > 1 (:func:`interleaved_order`, Megatron's): microbatches in
  groups of S, each group going round the ring V times: step ``g*S*V + r*S + i`` is
  microbatch ``g*S + i`` in round r (V = 1: step k is microbatch k). Stage s runs
  backward step ``t - (V*S - 1) - (S - 1 - s)`` at tick t (:func:`backward_step`), its
  rounds counting down from V - 1: the last stage runs a microbatch's last forward, its
  loss and its first backward step in one tick.
"""

from __future__ import annotations

from typing import Any


def forward_step(t: Any, s: Any) -> Any:
    """The step stage s runs forward at tick t (all schedules)."""
    return t - s


def backward_step(t: Any, s: Any, S: int, V: int) -> Any:
    """The step stage s runs backward at tick t (1F1B): ``V*S - 1`` ticks after the last
    stage ran it forward, one stage back per tick."""
    return t - (V * S - 1) - (S - 1 - s)


def is_step(k: Any, M: int, V: int) -> Any:
    """Whether k is one of a stage's ``M*V`` steps (else the stage idles: a bubble)."""
    return (k >= 0) & (k < M * V)


def circular_order(k: Any, M: int) -> tuple[Any, Any]:
    """``(microbatch, round)`` of step k for GPipe and the circular schedule."""
    return k % M, k // M


def returned_step(t: Any, S: int) -> Any:
    """The step whose output reaches stage 0 at tick t, round the ring: the one the last
    stage ran at tick t - 1 (circular schedule)."""
    return forward_step(t - 1, S - 1)


def interleaved_order(k: Any, S: int, V: int) -> tuple[Any, Any]:
    """``(microbatch, round)`` of step k for (interleaved) 1F1B: ``k = g*S*V + r*S + i`` is
    microbatch ``g*S + i`` in round r."""
    g, rest = k // (S * V), k % (S * V)
    return g * S + rest % S, rest // S


def interleaved_step(m: Any, r: Any, S: int, V: int) -> Any:
    """The step of microbatch m in round r (:func:`interleaved_order`'s inverse)."""
    return (m // S) * S * V + r * S + m % S


def gpipe_ticks(S: int, M: int, V: int) -> int:
    """GPipe's and the circular schedule's tick count, ``M*V + S - 1``: the last stage
    runs the last step at tick ``M*V - 1 + S - 1``."""
    return M * V + S - 1


def one_f_one_b_ticks(S: int, M: int, V: int) -> int:
    """1F1B's tick count, ``M*V + V*S + S - 2``: stage 0 runs the last backward step at
    tick ``(M*V - 1) + (V*S - 1) + (S - 1)``."""
    return M * V + V * S + S - 2


def one_f_one_b_phases(S: int, M: int, V: int) -> list[tuple[int, int, bool, bool]]:
    """1F1B's tick loops, ``(first tick, stop, forward, backward)``: before tick V*S - 1 no
    stage has a backward step, from tick M*V + S - 1 on none has a forward step, so the
    schedule costs M*V + S - 1 ticks of a forward and a backward."""
    fill, drain = V * S - 1, gpipe_ticks(S, M, V)
    loops = [
        (0, fill, True, False),
        (fill, drain, True, True),
        (drain, one_f_one_b_ticks(S, M, V), False, True),
    ]
    return [loop for loop in loops if loop[1] > loop[0]]


def ring_slots(S: int, M: int, V: int) -> int:
    """1F1B keeps each forward's input until its backward: a step's input lives at most
    ``2*V*S - 2`` ticks, so ``min(M*V, 2*V*S - 1)`` slots, indexed by step mod that."""
    return min(M * V, 2 * V * S - 1)
