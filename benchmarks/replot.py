"""Redraws the saved figures from their CSVs, with the jax version and machine each CSV
recorded in the title (``stackwise-bench --plot`` draws the same figure as it measures):

    python benchmarks/replot.py            # results/{mlp,decode,pattern}.png

Use it when the figure's drawing changes, not its data.
"""

from __future__ import annotations

import argparse
import csv
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
FIGURES = ("mlp", "decode", "pattern")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)  # (no options: --help, and a refusal of any other argument)
    from stackwise.bench import read_csv, write_plot  # (imports JAX: after the command line)

    for name in FIGURES:
        path = RESULTS / f"{name}.csv"
        with path.open(newline="") as f:
            (recorded,) = {(row["jax"], row["machine"]) for row in csv.DictReader(f)}
        title = f"stackwise-bench: jax {recorded[0]}, {recorded[1]}"
        note = write_plot(read_csv(str(path)), str(RESULTS / f"{name}.png"), title=title)
        print(f"note: {note}" if note else f"wrote {RESULTS / f'{name}.png'}")


if __name__ == "__main__":
    main()
