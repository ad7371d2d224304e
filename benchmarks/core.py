"""The core comparison (issue 2): the MLP residual block at n = 8, 24, 48, 96, and its targets.

Runs ``stackwise-bench --blocks mlp --compile-repeats 3``, writing ``results/mlp.csv``,
``results/mlp.png`` and ``results/mlp.md`` next to this file, then checks the project's
targets on that CSV (``targets.py``). Extra arguments go to ``stackwise-bench``, e.g.
``--rounds 15``; see ``README.md`` for the other saved runs.

    python benchmarks/core.py > benchmarks/results/mlp.txt
"""

import pathlib
import sys

import targets  # benchmarks/targets.py, next to this script

if __name__ == "__main__":
    from stackwise.bench import main  # (its --help imports JAX, with `import stackwise`)

    results = pathlib.Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    csv = str(results / "mlp.csv")
    status = main([
        "--blocks", "mlp", "--n", "8,24,48,96", "--compile-repeats", "3", "--no-progress",
        "--csv", csv, "--plot", str(results / "mlp.png"), "--markdown", str(results / "mlp.md"),
        *sys.argv[1:],
    ])
    sys.exit(status or targets.main([csv]))
