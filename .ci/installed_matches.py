"""Is the importable stackwise the checkout's? A TPU host imports the package from the wheel that
shared/tpu/prepare built (under /tmp, on PYTHONPATH), not from the checkout: a wheel built
before the last change runs old code under the new tests and benchmarks, and nothing says so.

    python3 -P CHECKOUT/.ci/installed_matches.py CHECKOUT

compares every Python file of each package in pyproject.toml's ``package-dir`` (stackwise, the
adapters, the bench) with the installed one, and exits 1 naming the files that differ or are
missing (rerun ../shared/tpu/prepare, and ship .tpu/ again); 0 when all match. An editable
install imports the checkout itself, and matches.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import tomllib


def installed_dir(package: str) -> pathlib.Path | None:
    """Where the importable ``package`` lives, or None when it cannot be imported."""
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:  # (its parent package is not importable)
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def differences(root: pathlib.Path) -> list[str]:
    """``package/file.py`` for each checkout file the installed package lacks or holds
    otherwise, with why (``package`` alone when it cannot be imported)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    found, seen = [], set()
    for package, source in mapping.items():
        there = installed_dir(package)
        if there is None:
            found.append(f"{package}: not importable")
            continue
        for path in sorted((root / source).rglob("*.py")):
            if path in seen:  # (a subpackage mapped on its own: bench/workloads)
                continue
            seen.add(path)
            rel = path.relative_to(root / source)
            name = f"{package}/{rel.as_posix()}"
            if not (there / rel).is_file():
                found.append(f"{name}: not installed")
            elif (there / rel).read_bytes() != path.read_bytes():
                found.append(f"{name}: differs from the checkout's")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (pathlib.Path(argv[0]) / "pyproject.toml").is_file():
        print("usage: python3 -P .ci/installed_matches.py CHECKOUT (the folder holding "
              "pyproject.toml)", file=sys.stderr)
        return 2
    found = differences(pathlib.Path(argv[0]).resolve())
    if found:
        print(f"the installed stackwise is not the checkout's ({len(found)} differences): "
              + "; ".join(found[:8]) + ("; ..." if len(found) > 8 else "")
              + ". Rebuild its wheel: run ../shared/tpu/prepare in the checkout and ship .tpu/ "
              "again.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
