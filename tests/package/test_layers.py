"""The package's layers import downward only, and adapters use the adapter kit alone.

Read from the sources (every ``import`` and ``from ... import`` statement, at any depth), so a
lazy import inside a function counts too. The layers, lowest first:

- ``stackwise._core`` (and ``stackwise._upstream``): jax and numpy only;
- ``stackwise._sharding``: the core;
- ``stackwise._finetune`` (LoRA and quantized weights, ``stackwise.lora`` / ``stackwise.quant``):
  the core;
- ``stackwise._pipeline`` and ``stackwise._checkpoint``: the core and sharding (not each other);
  the checkpoint also the quantizer of ``_finetune`` (``load_checkpoint(quantize=)``);
- ``stackwise._kit``: the core and ``_finetune`` (it is what adapters see of them);
- ``stackwise._autostack`` (``stackwise.autostack``, loop models run as a scan): the core;
- the adapters (``adapters/<framework>/``, installed as ``stackwise.<framework>``): the kit,
  the public ``stackwise`` names and their own package; never a private module of the core.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "stackwise"

#: Which private parts of stackwise each layer may import (besides itself).
ALLOWED = {
    "_core": {"_core", "_upstream"},
    "_upstream": {"_upstream"},
    "_sharding": {"_core", "_upstream", "_sharding"},
    "_pipeline": {"_core", "_upstream", "_sharding", "_pipeline"},
    "_checkpoint": {"_core", "_upstream", "_sharding", "_checkpoint", "_finetune"},
    "_kit": {"_core", "_upstream", "_finetune", "_kit"},
    "_finetune": {"_core", "_upstream", "_finetune"},
    "_autostack": {"_core", "_upstream", "_autostack"},
}


def imported(path: pathlib.Path) -> list[str]:
    """Every module that ``path`` imports from stackwise, as dotted names."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "stackwise"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "stackwise":
                out += [f"stackwise.{a.name}" for a in node.names]
            elif node.module.split(".")[0] == "stackwise":
                out.append(node.module)
    return out


def layer_of(module: str) -> str | None:
    """``stackwise._core.stack`` -> ``_core``; a public name of ``stackwise`` -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1].startswith("_") else None


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(layer):
    folder = PACKAGE / layer
    if not folder.is_dir():
        pytest.skip(f"no {layer} in this tree")
    wrong = []
    for path in sorted(folder.rglob("*.py")):
        for module in imported(path):
            below = layer_of(module)
            if below is None or below not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_stackwise_has_no_flat_private_modules_left():
    """Every private module lives in one of the layers' packages."""
    flat = sorted(p.name for p in PACKAGE.glob("_*.py") if p.name != "__init__.py")
    assert flat == []
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name.startswith("_")
            and not p.name.startswith("__")} <= set(ALLOWED)


def test_adapters_use_the_kit_and_public_names_only():
    wrong = []
    for path in sorted((ROOT / "adapters").rglob("*.py")):
        for module in imported(path):
            layer = layer_of(module)
            if layer is not None and layer != "_kit":
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_a_wrong_import_is_caught(tmp_path):
    """The reading above sees imports at any depth and in every form (the test can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import stackwise._pipeline.api\n"
        "def f():\n    from stackwise._checkpoint import load\n"
        "from stackwise import _kit\n"
    )
    found = sorted(imported(bad))
    assert found == ["stackwise._checkpoint", "stackwise._kit", "stackwise._pipeline.api"]
    assert [layer_of(m) for m in found] == ["_checkpoint", "_kit", "_pipeline"]


def test_no_private_name_crosses_modules():
    """What one module of stackwise uses of another is that module's unprefixed name: a
    ``_name`` stays in the module that defines it (``from stackwise... import _x`` is refused,
    as is ``module._x`` on an imported module)."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stackwise"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        where = path.relative_to(ROOT)
                        wrong.append(f"{where}: from {node.module} import {a.name}")
                    elif node.module in ("stackwise", "stackwise._core", "stackwise._checkpoint",
                                         "stackwise._pipeline", "stackwise._sharding",
                                         "stackwise._kit", "stackwise._upstream"):
                        modules.add(a.asname or a.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                wrong.append(f"{path.relative_to(ROOT)}: {node.value.id}.{node.attr}")
    assert not wrong, "\n".join(sorted(set(wrong)))
