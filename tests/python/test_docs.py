"""The documentation runs: every Python snippet of README.md and docs/*.md (each on its own, where
what it needs is here: PyTorch and JAX on the CPU are enough; a hub model or fla is not) and
examples/numpy_example.py; and the README's results table is the rendering of bench/results/*.csv."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
SNIPPETS = [(f"{doc.relative_to(ROOT)}:{i}", code) for doc in DOCS
            for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S))]
# What a snippet needs beyond the package: a module, or (for a hub model and fla) more than a test has.
NEEDS = {"torch": "import torch", "jax": "import jax", "a hub model and transformers": "from_pretrained",
         "a GPU and flash-linear-attention": "fla_backend",
         "megatron-core and a model on initialised ranks": "integrations.megatron"}


def _missing(code: str):
    for what, marker in NEEDS.items():
        if marker in code and (what not in ("torch", "jax") or importlib.util.find_spec(what) is None):
            return what
    return None


@pytest.mark.parametrize("where, code", SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_doc_snippet_runs(where, code):
    missing = _missing(code)
    if missing:
        pytest.skip(f"needs {missing}")
    if "import jax" in code:
        pytest.importorskip("headloss.jax", reason="no JAX adapter")
    exec(compile(code, where, "exec"), {"__name__": "doc_snippet"})


def test_numpy_example_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "numpy_example.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("OK")


def _results_tool():
    spec = importlib.util.spec_from_file_location("results_tool", ROOT / "tools" / "results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_results_table_is_the_rendering_of_the_data():
    """The README's results table is tools/results.py's rendering of bench/results/*.csv, so the front page
    and the data cannot disagree (after a new run: tools/results.py --write)."""
    if not list((ROOT / "bench" / "results").glob("*.csv")):
        pytest.skip("no bench/results/*.csv here (an sdist leaves them out)")
    tool = _results_tool()
    assert tool.readme_table((ROOT / "README.md").read_text()) == tool.render(), \
        "README.md's results table differs from the data: run tools/results.py --write"


@pytest.mark.parametrize("md, family", [("linear_memory_h200.md", "linear_loss"), ("hf_llama_h200.md", "hf_llama")])
def test_results_add_reads_a_benchmark_output_as_committed(md, family):
    """tools/results.py add's reader, on a benchmark's output as committed, gives the rows the CSV holds."""
    path = ROOT / "bench" / "results" / md
    if not path.exists():
        pytest.skip("no bench/results here (an sdist leaves them out)")
    tool = _results_tool()
    text = path.read_text()
    rows = tool.rows_of(family, text, dict(tool.header_context(text), source=md))
    assert rows and rows == [r for r in tool.load(family) if r["source"] == md]


# Paths a file may name that the repository does not ship, each for its reason.
NOT_SHIPPED = {
    "python/headloss/_abi.py": "generated from the header by the build (tools/gen_abi.py)",
    "bench/out": "the benchmarks' output folder (tools/bench.sh)",
    "src/consumer.c": "the scratch project tests/package/consumer.sh writes",
    "tests/ops": "flash-linear-attention's tests (bench/experiments/fla_dropin.py runs them)",
    "tests/ops/test_gdn.py": "flash-linear-attention's tests",
    "tests/python/test_x.py": "an example of tools/device.sh's HL_TESTS",
}
TOP = ("bench", "src", "kernels", "include", "tools", "tests", "examples", "docs", "python", "cmake")
PATH = re.compile(r"(?<![\w./:<-])((?:%s)/[\w./-]*\w)" % "|".join(TOP))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
TEXT = (".md", ".py", ".c", ".h", ".cpp", ".cu", ".cuh", ".sh", ".cmake", ".txt", ".toml", ".map", ".cc")


def _shipped_files():
    r = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("not a git checkout: the shipped files are git's")
    return [f for f in r.stdout.split() if f.endswith(TEXT) or Path(f).name in ("Makefile", "CMakeLists.txt")]


def test_nothing_cites_a_file_the_repository_does_not_ship():
    """Every path a tracked file names (bench/..., src/..., docs/..., ...) and every relative Markdown
    link exists in the tree; no file cites a document outside the repository."""
    missing, foreign = [], []
    outside = ("SP" + "EC", "../" + "shared")  # written so that this file does not name them
    for f in _shipped_files():
        text = (ROOT / f).read_text(errors="replace")
        for m in PATH.finditer(text):
            p = m.group(1).rstrip(".")
            if "NAME" in p or p.endswith("_") or p in NOT_SHIPPED or (ROOT / p).exists():
                continue
            missing.append(f"{f}: {p}")
        if f.endswith(".md"):
            for m in LINK.finditer(text):
                target = m.group(1)
                if "://" in target or target.startswith("mailto:"):
                    continue
                if not (ROOT / f).parent.joinpath(target).resolve().exists():
                    missing.append(f"{f}: link {target}")
        for word in outside:
            if re.search(r"\b%s\b" % re.escape(word) if word.isalpha() else re.escape(word), text):
                foreign.append(f"{f}: {word}")
    assert not missing, "files named that the repository does not ship:\n" + "\n".join(missing)
    assert not foreign, "citations of documents outside the repository:\n" + "\n".join(foreign)
