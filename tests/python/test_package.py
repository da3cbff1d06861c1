"""`pip wheel .` and the wheel installed as a user gets it: a CPU-only build
(-Ccmake.define.HL_CUDA=OFF) into a fresh venv, the package imported from outside the checkout
with the library bundled in it, a loss and an RMSNorm checked against NumPy; with jax present, the
bundled JAX adapter too. It needs PyPI (scikit-build-core, numpy) and about a minute of build:
it runs where HL_PIP_TEST=1 (tools/test.sh sets it) and skips elsewhere (the GPU machine is offline).
The wheel holds the ABI module the build generates (headloss/_abi.py), once."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = r"""
import sys
from pathlib import Path
import numpy as np
import headloss
here = Path(headloss.__file__).parent
assert Path(headloss._lib.lib_path).parent == here, headloss._lib.lib_path   # the bundled copy
assert headloss.version() == sys.argv[1], (headloss.version(), sys.argv[1])
rng = np.random.default_rng(0)
z = rng.standard_normal((5, 11)).astype(np.float32)
y = np.array([3, -100, 0, 10, 7])
out = headloss.LossPlan(11, "float32", terms=("ce",))(z, y)
lse = np.log(np.exp(z.astype(np.float64)).sum(1))
ok = y >= 0
ref = (lse[ok] - z[ok, y[ok]]).mean()
assert abs(out.as_dict()["loss"] - ref) < 1e-5 * abs(ref), (out.as_dict()["loss"], ref)
x = rng.standard_normal((3, 8)).astype(np.float32)
r = headloss.rmsnorm(x, None, eps=1e-6)
assert np.allclose(r, x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6), rtol=1e-6)
if sys.argv[2] == "jax":
    import jax.numpy as jnp
    import headloss.jax as hlj
    assert Path(hlj.adapter_path).parent == here, hlj.adapter_path
    loss, _ = hlj.fused_loss(jnp.asarray(z), jnp.asarray(y, jnp.int32))
    assert abs(float(loss) - ref) < 1e-5 * abs(ref), (float(loss), ref)
print("installed package ok:", headloss.version(), sys.argv[2])
"""


def _run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_pip_wheel_cpu_only_installs_and_runs(tmp_path):
    if os.environ.get("HL_PIP_TEST") != "1":
        pytest.skip("set HL_PIP_TEST=1 to build the wheel with pip (needs PyPI; tools/test.sh sets it)")
    try:
        import jax  # noqa: F401
        with_jax = True  # the build finds it in this interpreter and bundles the adapter
    except ImportError:
        with_jax = False
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", ROOT,
          "-Ccmake.define.HL_CUDA=OFF"])
    (wheel,) = (tmp_path / "dist").glob("headloss-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "headloss/libheadloss.so.0" in names and "headloss/__init__.py" in names, names
    assert names.count("headloss/_abi.py") == 1, names  # generated from the header by the build
    assert ("headloss/libheadloss_jax.so" in names) == with_jax, names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    py = venv / "bin" / "python"
    _run([py, "-m", "pip", "install", "-q", wheel] + (["jax"] if with_jax else []))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HEADLOSS_LIBRARY",
                                                             "HEADLOSS_JAX_LIBRARY")}
    version = ".".join(str(int(v)) for v in _header_version())
    out = _run([py, "-c", CHECK, version, "jax" if with_jax else "-"], cwd=tmp_path, env=env)
    assert "installed package ok" in out


def _header_version():
    text = (ROOT / "include" / "headloss.h").read_text()
    return [text.split(f"#define HL_VERSION_{k} ")[1].split()[0] for k in ("MAJOR", "MINOR", "PATCH")]
