"""`import stackwise` must not import any framework."""

import os
import subprocess
import sys


def test_import_stackwise_imports_no_framework():
    code = (
        "import sys, stackwise\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('haiku', 'flax', 'equinox', 'optax', 'matplotlib', 'rich', 'tqdm', "
        "'safetensors', 'orbax', 'tensorstore'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import stackwise imported: {out.stdout}"


def test_no_top_level_adapters_package():
    code = "import importlib.util; print(importlib.util.find_spec('adapters'))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as an installed user
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/", env=env
    )
    assert out.stdout.strip() == "None"
