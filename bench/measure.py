"""Measuring: cold compiles, steady-state steps and memory, in shuffled, paired repeats.

For every depth n of a block, every variant is

1. built (params and input, from numpy: nothing is compiled yet);
2. compiled cold ``compile_repeats`` times (:func:`jax.clear_caches` and a garbage
   collection first, then ``jit(grad(loss)).lower(params, x).compile()`` timed, tracing
   included; ``jit(loss)`` for a block whose ``grad`` is False; ``jit(step,
   donate_argnums=1).lower(params, state, x)`` for a block with ``state``), each repeat
   visiting the variants in a new seeded shuffle; the first compile also records the
   program: its size, the bytes passing optimisation barriers
   (:func:`~stackwise.bench.barriers.optimization_barrier_bytes`), its fingerprint,
   ``memory_analysis().temp_size_in_bytes`` and the bytes of the state;
3. timed for ``rounds`` rounds, each visiting the variants in a new seeded shuffle and
   timing the second of two back-to-back calls (the first leaves the machine as the
   variant's own steps would, not as the previous variant left it). A step with state
   is given the state its previous call returned (the one before was donated to it).

With ``warmup``, every variant is first compiled and run once at a tiny depth (not
recorded), so one-time costs (imports, a framework's first trace) are charged to nobody.
With ``one_at_a_time``, steps 1-3 run for one variant after another (its compiles, then its
rounds), and its params, state and program are freed before the next is built: the device
holds one variant at a time, and the rounds are no longer interleaved.
A variant that fails is dropped with a note; the rest go on.
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from stackwise.bench import workloads
from stackwise.bench.barriers import optimization_barrier_bytes
from stackwise.bench.config import DEC_DTYPES, BenchConfig, Result
from stackwise.bench.programs import (
    instructions_unlike,
    program_fingerprint,
    program_instructions,
)
from stackwise.bench.stats import paired_ratio
from stackwise.bench.workloads import Case

__all__ = ["FAILED", "fill_ratios", "plan", "run_benchmark"]

#: In the note of each variant that failed (and was left out).
FAILED = "failed, skipped"
#: The note of a run stopped by SIGINT (Ctrl-C, ``timeout -s INT``).
INTERRUPTED = "stopped by an interrupt"


def run_benchmark(
    cfg: BenchConfig, *, progress: bool = True, log: Callable[[str], None] = print
) -> tuple[list[Result], list[str]]:
    """Runs every selected variant at every depth.

    Args:
      cfg: what to measure.
      progress: show a progress bar on stderr (rich, else tqdm, else none).
      log: where notes go as they happen.

    Returns:
      ``(results, notes)``: one :class:`~stackwise.bench.Result` per measured variant and
      depth (ratios filled in), and notes on what was skipped and why. A KeyboardInterrupt
      (SIGINT) ends the run with the depths measured so far (with ``cfg.one_at_a_time``, and
      the variants measured whole at the depth it stopped) and an :data:`INTERRUPTED` note.

    Raises:
      ValueError: an unknown block, depths a block does not accept, or a ``cfg.variants``
        entry that matches no variant (the message lists the variants there are and what
        could not be imported).
    """
    notes: list[str] = []
    blocks = plan(cfg, notes)
    for note in notes:
        log(f"note: {note}")
    total = sum(  # (one at a time: each variant's own rounds; else rounds of all at once)
        len(cases) * cfg.warmup + len(ns) * (len(cases) * cfg.compile_repeats
                                             + (len(cases) if cfg.one_at_a_time else 1)
                                             * (cfg.rounds + 1))
        for _, cases, ns in blocks
    )
    bar = _Progress(total, progress)
    results: list[Result] = []
    try:
        for block, cases, ns in blocks:
            _BlockRun(block, cfg, bar, notes, log).run(cases, ns, results)
    except KeyboardInterrupt:  # (e.g. `timeout -s INT`): what was measured is reported
        notes.append(f"{INTERRUPTED}: the depths measured before it are reported (one at a "
                     "time, also the variants done at the depth it stopped), the rest is not.")
        log(f"note: {notes[-1]}")
    finally:
        bar.close()
    fill_ratios(results)
    return results, notes


def plan(cfg: BenchConfig, notes: list[str]) -> list[tuple[str, list[Case], tuple[int, ...]]]:
    """``(block, cases, depths)`` for every block with a selected variant.

    A block none of whose variants is selected is left out with a note. Raises a ValueError
    that lists the variants there are if nothing at all is selected or a ``cfg.variants``
    entry selects nothing, and one for depths a block's rows do not accept.
    """
    if cfg.dec_dtype not in DEC_DTYPES:
        raise ValueError(f"dec_dtype={cfg.dec_dtype!r}: the decode and prefill blocks run in "
                         f"{' or '.join(DEC_DTYPES)}; give one of them.")
    out, every = [], []
    for block in cfg.blocks:
        entry = workloads.BLOCKS[block]
        if min(workloads.depths(block, cfg)) < entry.min_n:
            raise ValueError(
                f"{entry.depths}={workloads.depths(block, cfg)}: the {block} block's rows need "
                f"n >= {entry.min_n}; give depths of at least {entry.min_n}."
            )
        cases = workloads.cases(block, cfg, notes)
        every += cases
        chosen = workloads.select(cases, cfg.variants)
        if chosen:
            out.append((block, chosen, workloads.depths(block, cfg)))
        elif cases:
            notes.append(f"{block}: no variant matches {', '.join(cfg.variants)}; not run.")
    if not out:
        skipped = "".join(f"\n  {note}" for note in notes if "skipped" in note)
        elsewhere = "".join(
            f"\n  The {block} block (not run) has {len(chosen)} that match: "
            f"{', '.join(c.name for c in chosen)}."
            for block in workloads.BLOCKS if block not in cfg.blocks
            for chosen in [workloads.select(workloads.cases(block, cfg, []), cfg.variants)]
            if chosen
        ) if cfg.variants else ""
        names = ", ".join(dict.fromkeys(c.name for c in every)) or "none"
        raise ValueError(
            f"no variant of the blocks {', '.join(cfg.blocks)} matches "
            f"{', '.join(cfg.variants) or 'anything'}.{skipped}{elsewhere}\n"
            f"  A variant runs if its name contains one of the strings, or its framework "
            f"({', '.join(workloads.frameworks())}) is one. The variants here are: {names}."
        )
    unmatched = [wanted for wanted in cfg.variants if not workloads.select(every, [wanted])]
    if unmatched:  # a typo: running the others alone would look like a whole run
        names = ", ".join(dict.fromkeys(c.name for c in every))
        raise ValueError(
            f"{', '.join(map(repr, unmatched))} matches no variant of the blocks "
            f"{', '.join(cfg.blocks)}; the variants there are: {names}."
        )
    return out


def fill_ratios(results: list[Result]) -> None:
    """Sets each result's ``/scan``, ``/loop`` and ``/tool`` ratios: paired ratios to the
    hand-written scan, the Python loop and its tool, at the same block and depth."""
    by_key = {(r.block, r.n, r.variant): r for r in results}
    for r in results:
        for ref_name, suffix in ((workloads.SCAN, "scan"), (workloads.LOOP, "loop"),
                                 (r.tool, "tool")):
            ref = by_key.get((r.block, r.n, ref_name)) if ref_name else None
            if ref is not None:
                for what in ("compile", "step"):
                    setattr(r, f"{what}_vs_{suffix}", paired_ratio(r, ref, what))


# ==========================================================================
# One block, depth by depth.


class _Compiled:
    """A compiled step and its arguments; ``state`` (None without) is replaced by what
    each call returns, since the call consumed (was donated) the one it was given."""

    def __init__(self, fn: Callable, params: Any, x: Any, state: Any = None):
        self.fn, self.params, self.x, self.state = fn, params, x, state


class _BlockRun:
    """Measures one block's cases at each depth (the steps of the module docstring)."""

    def __init__(self, block: str, cfg: BenchConfig, bar: _Progress, notes: list[str], log):
        self.block, self.cfg, self.bar, self.notes, self.log = block, cfg, bar, notes, log
        self.grad = workloads.BLOCKS[block].grad
        self.state = workloads.BLOCKS[block].state
        self.options = {"xla_backend_optimization_level": 0} if cfg.smoke else None

    def failed(self, where: str, e: BaseException) -> None:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        note = f"{self.block}/{where}: {FAILED} ({type(e).__name__}: {first[:200]})"
        if "RESOURCE_EXHAUSTED" in str(e):
            note += (" - out of device memory with this variant alone: give smaller sizes"
                     if self.cfg.one_at_a_time else  # every variant of a depth is held at once
                     " - out of device memory: every selected variant's params and state "
                     "are held together while their steps are timed in turns; select fewer "
                     "with --variants, measure them --one-at-a-time, or give smaller sizes")
        self.notes.append(note)
        self.log(f"note: {note}")

    def run(self, cases: list[Case], ns: Sequence[int], results: list[Result]) -> None:
        """Measures ``cases`` at every depth of ``ns``, appending each depth's rows to
        ``results`` once they are all timed (an interrupt keeps the depths done and, one at a
        time, the variants done at its depth)."""
        small = min(workloads.BLOCKS[self.block].warmup_n, *ns)
        start = time.perf_counter()
        working = self.warm_up(cases, small) if self.cfg.warmup else list(cases)
        if self.cfg.warmup:
            self.say(f"{self.block}: warm-up at n={small} in {time.perf_counter() - start:.1f} s")
        for n in ns:
            rows = {c.name: Result(self.block, n, c.framework, c.name, c.remat, tool=c.tool)
                    for c in working}
            programs: dict[str, list[str]] = {}
            measured: list[str] = []
            try:
                for group in ([[c] for c in working] if self.cfg.one_at_a_time else [working]):
                    marks = [time.perf_counter()]
                    built = self.build(group, n)
                    marks.append(time.perf_counter())
                    compiled = self.compile(rows, built, n, programs)
                    marks.append(time.perf_counter())
                    self.time_steps(rows, compiled, n)
                    marks.append(time.perf_counter())
                    self.say_phases(n, group, marks)
                    measured += compiled
                    del compiled  # (one at a time: its params, state and program go first)
                    gc.collect()
            except KeyboardInterrupt:
                # One at a time, each variant measured before the interrupt is whole: kept.
                if self.cfg.one_at_a_time and measured:
                    self.notes.append(f"{self.block} n={n}: {len(measured)} of {len(working)} "
                                      "variants measured (one at a time) before the interrupt: "
                                      "reported")
                    self.log(f"note: {self.notes[-1]}")
                    results += self.finish(working, rows, programs, measured)
                raise
            self.say(f"{self.block} n={n}: measured {len(measured)} variants")
            results += self.finish(working, rows, programs, measured)

    def say(self, line: str) -> None:
        """Logs ``line`` where no live progress bar says where the run is (stderr is not a
        terminal: a log file, a chip's run)."""
        if not sys.stderr.isatty():
            self.log(line)

    def say_phases(self, n: int, group: list[Case], marks: list[float]) -> None:
        """Where a group's seconds went (``marks``: its start, then the end of building,
        compiling and timing it): the variant's name, one at a time, else their number."""
        what = group[0].name if len(group) == 1 else f"{len(group)} variants"
        build, compile_, steps = (b - a for a, b in zip(marks, marks[1:]))
        self.say(f"{self.block} n={n}: {what}: built in {build:.1f} s, compiled in "
                 f"{compile_:.1f} s, timed in {steps:.1f} s")

    @staticmethod
    def finish(cases: list[Case], rows: dict[str, Result], programs: dict[str, list[str]],
               measured: list[str]) -> list[Result]:
        """The measured rows of one depth, in the cases' order, each given how many of its
        program's instructions its tool's lacks (where both were read)."""
        for row in rows.values():
            if row.variant in programs and row.tool in programs:
                row.ops_unlike_tool = instructions_unlike(programs[row.variant],
                                                          programs[row.tool])
        return [rows[c.name] for c in cases if c.name in measured]

    def build(self, cases: list[Case], n: int) -> dict[str, tuple]:
        """Each case's ``(params, ..., step)`` at depth ``n``; a case that fails is noted."""
        built = {}
        for case in cases:
            self.bar.describe(f"{self.block} n={n}: build {case.name}")
            try:
                built[case.name] = _build(case, n)
            except Exception as e:  # noqa: BLE001 - a broken variant is reported, not fatal
                self.failed(f"{case.name} n={n}", e)
        return built

    def warm_up(self, cases: list[Case], n: int) -> list[Case]:
        """Each case once at depth ``n``, not recorded; the ones that work."""
        working = []
        for case in cases:
            self.bar.describe(f"{self.block}: warm-up {case.name}")
            try:
                compiled, *_ = _compile(_build(case, n), self.grad, self.state, self.options)
                _time_call(compiled)
                working.append(case)
            except Exception as e:  # noqa: BLE001
                self.failed(case.name, e)
            self.bar.advance()
        return working

    def compile(
        self, rows: dict[str, Result], built: dict, n: int, programs: dict[str, list[str]]
    ) -> dict[str, _Compiled]:
        """The cold compiles, shuffled per repeat; records each program on its first (its
        instructions into ``programs``)."""
        compiled = {}
        for repeat in range(self.cfg.compile_repeats):
            for name in _shuffled(list(built), self.cfg.seed, repeat):
                self.bar.describe(f"{self.block} n={n}: compile {name}")
                try:
                    c, seconds, traced, lowered = _compile(
                        built[name], self.grad, self.state, self.options
                    )
                except Exception as e:  # noqa: BLE001
                    self.failed(f"{name} n={n}", e)
                    del built[name]
                    compiled.pop(name, None)
                    self.bar.advance()
                    continue
                row = rows[name]
                row.compile_samples += (seconds,)
                row.compile_s = min(row.compile_samples)
                row.trace_s = traced if repeat == 0 else min(row.trace_s, traced)
                if repeat == 0:
                    programs[name] = _record_program(row, c, lowered)
                compiled[name] = c
                self.bar.advance()
        return compiled

    def time_steps(self, rows: dict[str, Result], compiled: dict[str, _Compiled], n: int):
        """One warm-up call each, then ``rounds`` shuffled rounds of timed steps."""
        self.bar.describe(f"{self.block} n={n}: warm-up calls")
        for c in compiled.values():
            _time_call(c)
        self.bar.advance()
        rounds = self.cfg.rounds
        for r in range(rounds):
            self.bar.describe(f"{self.block} n={n}: step times, round {r + 1}/{rounds}")
            for name in _shuffled(list(compiled), self.cfg.seed, r):
                _time_call(compiled[name])  # untimed: the machine as this variant leaves it
                rows[name].step_samples += (_time_call(compiled[name]),)
            self.bar.advance()
        for name in compiled:
            rows[name].step_s = statistics.median(rows[name].step_samples)


def _build(case: Case, n: int) -> tuple:
    """``(params, x, loss)``, or ``(params, state, x, step)`` for a block with state."""
    return jax.block_until_ready(case.build(n))


def _compile(
    built: tuple, grad: bool, state: bool, options: dict | None = None
) -> tuple[_Compiled, float, float, Any]:
    """Compiles ``jit(grad(loss))`` (``jit(loss)`` without ``grad``; ``jit(step,
    donate_argnums=1)`` with ``state``) cold: caches cleared, garbage collected, then timed;
    ``options``: XLA's compiler options; given (:attr:`BenchConfig.smoke`), compiles warm.

    Returns the compiled function, the seconds of the whole compile and of its tracing
    and lowering part, and the lowered program.
    """
    if options is None:  # cold (a smoke run compiles warm, and at a low optimisation level)
        jax.clear_caches()
        gc.collect()
    start = time.perf_counter()
    if state:
        params, carried, x, step = built
        lowered = jax.jit(step, donate_argnums=1, keep_unused=True).lower(params, carried, x)
    else:
        (params, x, loss), carried = built, None
        lowered = jax.jit(jax.grad(loss) if grad else loss, keep_unused=True).lower(params, x)
    traced = time.perf_counter() - start
    compiled = lowered.compile(options)
    seconds = time.perf_counter() - start
    return _Compiled(compiled, params, x, carried), seconds, traced, lowered


def _record_program(row: Result, c: _Compiled, lowered: Any) -> list[str]:
    """Fills in ``row``'s program facts; returns the compiled program's instructions."""
    text = lowered.as_text()
    row.program_chars = len(text)
    barriers = optimization_barrier_bytes(text, len(jax.tree.leaves(c.params)))
    row.barrier_param_bytes = barriers.params
    row.barrier_const_bytes = barriers.consts
    row.barrier_ops = barriers.count
    if not barriers.exact:
        row.note = "barrier bytes approximate (a loop's trip count unread)"
    hlo = c.fn.as_text()
    row.program_hash = program_fingerprint(hlo)
    row.temp_bytes = int(getattr(c.fn.memory_analysis(), "temp_size_in_bytes", -1))
    if c.state is not None:
        row.state_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(c.state))
    return program_instructions(hlo)


def _time_call(c: _Compiled) -> float:
    start = time.perf_counter()
    if c.state is None:
        jax.block_until_ready(c.fn(c.params, c.x))
    else:  # the state given was donated: the next call takes the one returned
        _, c.state = jax.block_until_ready(c.fn(c.params, c.state, c.x))
    return time.perf_counter() - start


def _shuffled(names: list[str], seed: int, i: int) -> list[str]:
    """Repeat (or round) ``i``'s order: a seeded shuffle, so that no variant always runs
    right after the same one (a neighbour's state can bias a variant's times)."""
    return random.Random(f"{seed}/{i}").sample(names, len(names))


class _Progress:
    """A progress bar on stderr: rich if installed, else tqdm, else nothing."""

    def __init__(self, total: int, enabled: bool):
        self._rich = self._tqdm = self._task = None
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._rich = Progress(
                TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), console=Console(stderr=True), transient=False,
            )
            self._rich.start()
            self._task = self._rich.add_task("stackwise-bench", total=total)
        except ImportError:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm(total=total, file=sys.stderr, desc="stackwise-bench")
            except ImportError:
                pass

    def describe(self, text: str) -> None:
        if self._rich is not None:
            self._rich.update(self._task, description=text)
        elif self._tqdm is not None:
            self._tqdm.set_description(text)

    def advance(self, k: int = 1) -> None:
        if self._rich is not None:
            self._rich.advance(self._task, k)
        elif self._tqdm is not None:
            self._tqdm.update(k)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self._tqdm is not None:
            self._tqdm.close()
