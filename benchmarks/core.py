"""The core benchmark of issue 2: the MLP residual block at n in {8, 24, 48, 96}.

A thin wrapper over ``stackwise.bench`` (one implementation; see ``benchmarks/README.md``):
Python loops, a hand-written ``lax.scan`` and ``stackwise.stack`` with remat off / per
layer / nested, compared under ``jit(grad(loss))``. Extra arguments go to
``stackwise-bench``, e.g. ``python benchmarks/core.py --rounds 15 --compile-repeats 3``.

    python benchmarks/core.py
"""

import pathlib
import sys

from stackwise.bench import main

if __name__ == "__main__":
    results = pathlib.Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    defaults = [
        "--blocks", "mlp", "--n", "8,24,48,96",
        "--csv", str(results / "core.csv"), "--plot", str(results / "core.png"),
    ]
    sys.exit(main(defaults + sys.argv[1:]))
