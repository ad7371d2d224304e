"""`import stackwise` must not import any framework; its optional submodules load on first use.

The optional submodules (the adapters and the benchmark) are attributes of the package that
import themselves when first used (PEP 562, as scipy does), so that `import stackwise` then
`stackwise.haiku.Stack` works as the README writes it.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

import stackwise

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: The optional submodules, in the order the test uses them, and the framework each needs.
LAZY = {
    "bench": None, "haiku": "haiku", "flax": "flax", "nnx": "flax", "equinox": "equinox",
    "optax": "optax",
}
HEAVY = (
    "haiku", "flax", "equinox", "optax", "matplotlib", "rich", "tqdm",
    "safetensors", "orbax", "tensorstore", "qwix",
)


def test_import_stackwise_imports_no_framework_then_each_submodule_on_first_use():
    code = (
        "import json, sys, stackwise\n"
        f"heavy = {HEAVY!r}\n"
        "def loaded(): return sorted({m.split('.')[0] for m in sys.modules} & set(heavy))\n"
        "out = {'after import': loaded(), 'jax.extend': 'jax.extend' in sys.modules}\n"
        f"for name in {list(LAZY)!r}:\n"
        "    module = getattr(stackwise, name)\n"
        "    public = any(hasattr(module, a) for a in ('Stack', 'main', 'layerwise'))\n"
        "    out[name] = [module.__name__, sys.modules.get('stackwise.' + name) is module,\n"
        "                 public, loaded()]\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    out = json.loads(out.stdout)
    assert out.pop("after import") == [], "import stackwise imported a framework"
    # jax.extend (which loads Pallas) too: stackwise/_upstream/jax.py imports it on first use.
    assert out.pop("jax.extend") is False, "import stackwise imported jax.extend"
    assert list(out) == list(LAZY)
    for name, (module, registered, public, loaded) in out.items():
        assert (module, registered, public) == (f"stackwise.{name}", True, True), name
        assert LAZY[name] is None or LAZY[name] in loaded, name
    # The benchmark imports no framework, rich, tqdm or matplotlib until it runs; the
    # adapters load one at a time (dm-haiku itself imports flax).
    assert out["bench"][3] == [] and "equinox" not in out["nnx"][3]
    # qwix (an optional extra) loads only when a qwix bridge is called.
    assert all("qwix" not in loaded for *_, loaded in out.values())


def test_lazy_submodules_are_listed_and_other_names_are_attribute_errors():
    assert set(LAZY) <= set(dir(stackwise))
    assert {"stack", "stack_layers", "__version__"} <= set(dir(stackwise))
    with pytest.raises(AttributeError, match="module 'stackwise' has no attribute 'hiaku'"):
        stackwise.hiaku  # noqa: B018


def test_a_missing_framework_gets_the_install_hint(monkeypatch):
    for framework in ("haiku", "flax", "equinox", "optax"):  # as if not installed
        monkeypatch.setitem(sys.modules, framework, None)
    hints = {}
    for name in ("haiku", "flax", "nnx", "equinox", "optax"):
        monkeypatch.delitem(sys.modules, f"stackwise.{name}", raising=False)
        if name in vars(stackwise):  # (not hasattr: that would import it)
            monkeypatch.delattr(stackwise, name)
        with pytest.raises(ImportError) as e:
            getattr(stackwise, name)
        hints[name] = str(e.value)
    assert hints == {
        "haiku": "`stackwise.haiku` needs dm-haiku: pip install 'stackwise[haiku]'",
        "flax": "`stackwise.flax` needs flax: pip install 'stackwise[flax]'",
        "nnx": "`stackwise.nnx` needs flax: pip install 'stackwise[flax]'",
        "equinox": "`stackwise.equinox` needs equinox: pip install 'stackwise[equinox]'",
        "optax": "`stackwise.optax` needs optax: pip install 'stackwise[optax]'",
    }


def test_the_editable_install_offers_the_installed_modules_and_no_others():
    # Installed editable (as the tests run): the adapters from adapters/, the benchmark from
    # bench/ ...
    assert pathlib.Path(stackwise.__file__) == ROOT / "stackwise" / "__init__.py"
    bench = importlib.util.find_spec("stackwise.bench")
    assert pathlib.Path(bench.origin) == ROOT / "bench" / "__init__.py"
    workloads = importlib.util.find_spec("stackwise.bench.workloads")
    assert pathlib.Path(workloads.origin) == ROOT / "bench" / "workloads" / "__init__.py"
    haiku = importlib.util.find_spec("stackwise.haiku")
    assert pathlib.Path(haiku.origin) == ROOT / "adapters" / "haiku" / "__init__.py"
    # ... and none of the repository's other folders as `stackwise.<folder>`.
    # (`stackwise.egg-info` of an editable install is no module name: not a candidate)
    folders = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name.isidentifier())
    strays = [f for f in folders if f not in ("stackwise", "adapters", "bench")]
    assert {"tests", "examples", "benchmarks", "docs"} <= set(strays)
    for name in [*strays, "adapters", "stackwise", "bench.bench"]:
        assert importlib.util.find_spec(f"stackwise.{name}") is None, name


def test_a_checkout_that_is_not_installed_says_pip_install_e():
    """`stackwise/` imported from a checkout with no install of it: the core works, and an
    adapter or the benchmark, imported or used as an attribute, raises ImportError saying
    `pip install -e .` (no finder maps the checkout's folders into the package)."""
    code = (
        "import sys, stackwise\n"
        "print(stackwise.stack.__module__)\n"
        "for name in ('haiku', 'nnx', 'bench'):\n"
        "    for how in ('import', 'attribute'):\n"
        "        try:\n"
        "            if how == 'import': __import__('stackwise.' + name)\n"
        "            else: getattr(stackwise, name)\n"
        "        except ImportError as e: print(name, how, type(e).__name__, e)\n"
    )
    # -S: no site, so no .pth file and no editable install's finder; jax from PYTHONPATH.
    sites = [p for p in sys.path if p.endswith("site-packages")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sites]))
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, env=env).stdout.splitlines()
    assert out[0] == "stackwise._core.stack"
    assert len(out) == 7, out
    for line in out[1:]:
        name = line.split()[0]
        assert f"ModuleNotFoundError No module named 'stackwise.{name}'" in line, line
        assert "a source checkout that is not installed" in line and "`pip install -e .`" in line
    assert "pip install -e '.[flax]'" in out[3]


def test_no_top_level_adapters_or_bench_package():
    code = "import importlib.util as u; print(u.find_spec('adapters'), u.find_spec('bench'))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as an installed user
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/", env=env
    )
    assert out.stdout.strip() == "None None"


def test_stackwise_equinox_imports_quax_only_for_a_stack_holding_its_values():
    # quax is an optional extra: a Stack without quax values (run, differentiated) and
    # `stackwise.equinox.quaxify` as a name load nothing of it.
    code = (
        "import sys, jax, jax.numpy as jnp, equinox as eqx, stackwise.equinox\n"
        "from functools import partial\n"
        "s = stackwise.equinox.Stack(partial(eqx.nn.Linear, 2, 2), n=2, key=jax.random.key(0))\n"
        "s(jnp.ones(2)); jax.grad(lambda x: s(x).sum())(jnp.ones(2))\n"
        "stackwise.equinox.quaxify\n"
        "print('quax' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
