"""The documentation runs: every Python snippet of README.md (each on its own, where what it needs
is here: PyTorch and JAX on the CPU are enough; a hub model or fla is not) and
examples/numpy_example.py."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
# What a snippet needs beyond the package: a module, or (for a hub model and fla) more than a test has.
NEEDS = {"torch": "import torch", "jax": "import jax", "a hub model and transformers": "from_pretrained",
         "a GPU and flash-linear-attention": "fla_backend"}


def _missing(code: str):
    for what, marker in NEEDS.items():
        if marker in code and (what not in ("torch", "jax") or importlib.util.find_spec(what) is None):
            return what
    return None


@pytest.mark.parametrize("code", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_readme_snippet_runs(code):
    missing = _missing(code)
    if missing:
        pytest.skip(f"needs {missing}")
    if "import jax" in code:
        pytest.importorskip("headloss.jax", reason="no JAX adapter")
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})


def test_numpy_example_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "numpy_example.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("OK")
