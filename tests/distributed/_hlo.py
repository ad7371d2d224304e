"""Reading compiled (HLO) programs in the distributed tests: where the collectives are.

``collectives(compiled.as_text())`` lists every collective with its result
type and how many ``while`` loops enclose it (0: once per call; 1: once per
iteration of a scan; 2: inside a scan inside a scan), and
``loop_trip_counts`` the trip counts of the loops that run a given op, so
that tests can say "the gradient all-reduce runs once per step, after the
tick loop" or "the tick loop runs M + S - 1 times" from the program itself.
"""

from __future__ import annotations

import re

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_CALLS = re.compile(
    r"(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    comps, name, entry = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) \(", line)
        if head:
            name = head.group(2)
            comps[name] = []
            if head.group(1):
                entry = name
        elif name is not None:
            comps[name].append(line)
    return comps, entry


def _depths(comps: dict[str, list[str]], entry: str) -> dict[str, set[int]]:
    """Every loop depth at which each computation runs (crossing ``body=`` adds one)."""
    depths: dict[str, set[int]] = {}
    todo = [(entry, 0)]
    while todo:
        comp, depth = todo.pop()
        if depth in depths.setdefault(comp, set()):
            continue
        depths[comp].add(depth)
        for line in comps.get(comp, ()):
            for kind, callee in _CALLS.findall(line):
                todo.append((callee, depth + (kind == "body")))
            for group in _BRANCHES.findall(line):
                todo += [(c.strip().lstrip("%"), depth) for c in group.split(",")]
    return depths


def collectives(hlo: str) -> list[tuple[str, str, int]]:
    """``(op, result type, loop depth)`` for every collective of a compiled module."""
    comps, entry = _computations(hlo)
    depths = _depths(comps, entry)
    found = []
    for comp, lines in comps.items():
        for line in lines:
            m = re.search(r"= (\([^)]*\)|\S+) (" + "|".join(_OPS) + r")(?:-start)?\(", line)
            if m:
                for depth in sorted(depths.get(comp, {0})):
                    found.append((m.group(2), m.group(1), depth))
    return found


def loop_trip_counts(hlo: str, containing: str) -> list[int]:
    """Trip counts of the ``while`` loops whose body (at any depth) runs ``containing``.

    E.g. ``loop_trip_counts(text, "collective-permute")`` finds a pipeline's
    tick loop: the loop that hands activations from stage to stage.
    """
    comps, _ = _computations(hlo)
    counts = []
    for lines in comps.values():
        for line in lines:
            loop = re.search(r" while\(.*body=%([\w.\-]+)", line)
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            if loop and trips:
                inside = _depths(comps, loop.group(1))
                if any(re.search(rf" {containing}(?:-start)?\(", ln)
                       for c in inside for ln in comps.get(c, ())):
                    counts.append(int(trips.group(1)))
    return counts
