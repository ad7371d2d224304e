"""``python -m stackwise.bench``: the ``stackwise-bench`` command."""

import sys

from stackwise.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
