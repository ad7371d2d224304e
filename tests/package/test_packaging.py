"""The built package: the wheel and the sdist hold what they should, and a non-editable install
offers the same modules as the source tree, imported from outside the repository.

The layout: `stackwise/` is the core package; `adapters/<framework>/` is installed as
`stackwise/<framework>/` and `bench/` (the benchmark) as `stackwise/bench/` (setuptools
`package-dir`); there is no top-level `adapters` or `bench` module.
The expected files are derived from that rule and the source tree, not from pyproject.toml (the
thing under test), so an adapter folder that pyproject does not map fails here.

The build is what `python -m build` does, by hand: an sdist from a copy of the source tree, then
a wheel from the unpacked sdist (so the sdist is known to be complete), with the setuptools
release that build-system.requires names as its lower bound, installed by pip into a folder
(it reaches PyPI the first time, then pip's cache).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest

# Builds an sdist and a wheel: see `docs/contributing.md`, "Fast tests".
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: Folders of the source tree shipped in the sdist besides the wheel's sources (MANIFEST.in).
SDIST_EXTRA_DIRS = ("tests", "examples", "docs")
#: Top-level files of the sdist, besides what setuptools writes (PKG-INFO, setup.cfg, egg-info).
SDIST_TOP_FILES = ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in")
#: Never shipped, wherever they are.
JUNK = re.compile(r"(^|/)(__pycache__/|[^/]*\.py[cod]$)")
#: Ignored by git, so never in a checkout's sdist (trained example checkpoints).
IGNORED_DIRS = ("examples/checkpoints",)


def run(*cmd: str | os.PathLike, cwd: os.PathLike = ROOT, env: dict | None = None) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def source_files() -> list[str]:
    """The source tree's files (relative, '/'-separated) that a build can see."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        listed = run("git", "ls-files", "--cached", "--others", "--exclude-standard", "-z")
        files = [f for f in listed.split("\0") if f and (ROOT / f).is_file()]
    else:  # an unpacked sdist
        files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file()]
        files = [f for f in files if not f.startswith((".venv/", "build/", "dist/"))]
    return sorted(f for f in files if not JUNK.search(f))


def adapter_names() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "adapters").glob("*/__init__.py"))


def expected_package_files() -> dict[str, str]:
    """Installed path -> source path, for every file of the installed `stackwise` package."""
    files = {}
    for f in source_files():
        if f.startswith("stackwise/") and (f.endswith(".py") or f == "stackwise/py.typed"):
            files[f] = f
        elif f.startswith("adapters/") and f.endswith(".py"):
            files["stackwise/" + f.removeprefix("adapters/")] = f
        elif f.startswith("bench/") and f.endswith(".py"):
            files["stackwise/" + f] = f
    return files


def setuptools_lower_bound() -> str:
    pyproject = (ROOT / "pyproject.toml").read_text()
    requires = re.search(r"(?ms)^\[build-system\].*?^requires\s*=\s*\[(.*?)\]", pyproject)
    bound = re.search(r"""["']setuptools>=([\d.]+)["']""", requires.group(1))
    assert bound, f"build-system.requires names no setuptools lower bound: {requires.group(1)}"
    return bound.group(1)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Builds the sdist and (from it) the wheel, and installs the wheel into a folder."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    for f in source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)

    # The oldest setuptools release the lower bound admits (its latest patch).
    backend = tmp / "backend"
    bound = setuptools_lower_bound()
    pip = (sys.executable, "-m", "pip", "--disable-pip-version-check")
    run(*pip, "install", "--quiet", "--target", backend, f"setuptools~={bound}.0")
    # `-S`: only the stdlib and that setuptools, not the environment's own setuptools.
    env = dict(os.environ, PYTHONPATH=str(backend))
    hook = "import sys, setuptools.build_meta as b; print(getattr(b, sys.argv[1])(sys.argv[2]))"
    dist = tmp / "dist"
    dist.mkdir()
    sdist = run(sys.executable, "-S", "-c", hook, "build_sdist", dist, cwd=src, env=env)
    sdist = dist / sdist.splitlines()[-1]  # (the hook logs to stdout; its result is last)
    with tarfile.open(sdist) as tar:  # (extraction filters: Python >= 3.10.12, 3.11.4)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp / "unpacked", **safe)
    (unpacked,) = (tmp / "unpacked").iterdir()
    wheel = run(sys.executable, "-S", "-c", hook, "build_wheel", dist, cwd=unpacked, env=env)
    wheel = dist / wheel.splitlines()[-1]

    site = tmp / "site"
    run(*pip, "install", "--quiet", "--no-deps", "--no-index", "--target", site, wheel)
    return {"sdist": sdist, "wheel": wheel, "site": site, "tmp": tmp}


def test_setuptools_lower_bound_reads_the_spdx_license():
    # `license = "Apache-2.0"` (an SPDX expression, PEP 639) needs setuptools >= 77.
    assert re.search(r'(?m)^license = "Apache-2.0"$', (ROOT / "pyproject.toml").read_text())
    assert tuple(int(x) for x in setuptools_lower_bound().split(".")) >= (77,)


def test_wheel_contents(built):
    with zipfile.ZipFile(built["wheel"]) as whl:
        names = whl.namelist()
        package = sorted(n for n in names if ".dist-info/" not in n)
        expected = expected_package_files()
        # stackwise/**, stackwise/<framework>/**, stackwise/bench/** and py.typed; no `adapters`,
        # `bench`, tests or examples.
        assert package == sorted(expected)
        for installed, source in expected.items():
            assert whl.read(installed) == (ROOT / source).read_bytes(), installed
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = whl.read(metadata).decode()
        licenses = [n for n in names if ".dist-info/licenses/" in n]
    assert [pathlib.PurePosixPath(n).name for n in licenses] == ["LICENSE"]
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    extras = set(re.findall(r"(?m)^Provides-Extra: (\S+)$", metadata))
    assert {"haiku", "flax", "equinox", "all", "test"} <= extras
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (equinox,) = declared["optional-dependencies"]["equinox"]
    assert f'Requires-Dist: {equinox}; extra == "equinox"' in metadata.splitlines()
    assert f"Requires-Python: {declared['requires-python']}" in metadata.splitlines()


def test_sdist_contents(built):
    with tarfile.open(built["sdist"]) as tar:
        members = [m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()]
    written = {"PKG-INFO", "setup.cfg"}
    shipped = sorted(
        m for m in members if m not in written and not m.startswith("stackwise.egg-info/")
    )
    assert written <= set(members)
    dirs = ("stackwise/", "adapters/", "bench/", *(d + "/" for d in SDIST_EXTRA_DIRS))
    expected = sorted(
        f
        for f in source_files()
        if f in SDIST_TOP_FILES or (f.startswith(dirs) and not f.startswith(IGNORED_DIRS))
    )
    # Sources, adapters, the benchmark, tests, examples (with their data) and docs; not .ci/ or
    # benchmarks/.
    assert shipped == expected
    assert "examples/data/shakespeare.txt" in shipped and "LICENSE" in shipped


def test_installed_package_imports_from_anywhere(built):
    """`pip install .` (not editable), then import the package and every adapter, outside the
    repository (from its root, the checkout's `stackwise/` shadows the installed one, and its
    adapters then say so: the next test). `-S` (no `site`, so
    no `.pth` files) keeps out an editable install of stackwise in this environment, whose
    import hook would find the adapters anyway; the dependencies come from the environment's
    site-packages, on PYTHONPATH after the install.
    """
    site_packages = [p for p in sys.path if p.endswith("site-packages")]
    modules = ["stackwise", *(f"stackwise.{name}" for name in adapter_names()), "stackwise.bench"]
    modules.append("stackwise.bench.workloads")
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    print(name, importlib.import_module(name).__file__)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(built["site"]), *site_packages]))
    out = run(sys.executable, "-S", "-c", code, *modules, cwd=built["tmp"], env=env)
    files = dict(line.split(" ", 1) for line in out.splitlines())
    assert list(files) == modules
    for name, file in files.items():
        rel = name.replace(".", "/") + "/__init__.py"
        assert pathlib.Path(file) == built["site"] / rel


def test_the_installed_package_shadowed_by_the_checkout_says_so(built):
    # The README's old trap, with the real wheel: installed, then run in the checkout's root.
    site_packages = [p for p in sys.path if p.endswith("site-packages")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(built["site"]), *site_packages]))
    code = "import stackwise\ntry:\n    stackwise.haiku\nexcept ImportError as e:\n    print(e)\n"
    out = run(sys.executable, "-S", "-c", code, cwd=ROOT, env=env)
    assert f"the source folder {ROOT / 'stackwise'}, which shadows the installed" in out, out
    assert f"stackwise in {pathlib.Path(built['site']).resolve() / 'stackwise'}" in out, out
    assert "the current directory" in out and "`pip install -e '.[haiku]'`" in out, out


def test_installed_files_equal_the_source_tree(built):
    site = built["site"]
    installed = sorted(
        p.relative_to(site).as_posix()
        for p in (site / "stackwise").rglob("*")
        if p.is_file() and not JUNK.search(p.relative_to(site).as_posix())
    )
    expected = expected_package_files()
    assert installed == sorted(expected)
    for rel, source in expected.items():
        assert (site / rel).read_bytes() == (ROOT / source).read_bytes(), rel
    assert not (site / "adapters").exists() and not (site / "bench").exists()
    assert "bench/workloads/__init__.py" in {f.removeprefix("stackwise/") for f in installed}
