"""Build hook for `pip install ./python`: bundles the built C library into the package.

The metadata lives in pyproject.toml. When the checkout's lib/ holds a built libheadloss.so (run
`make` first), the real file is copied into the wheel as headloss/libheadloss.so.0 (its soname),
together with the JAX adapter libheadloss_jax.so when it was built; the package then loads its
bundled copy. Without a built library the package installs without one and looks for it at run
time ($HEADLOSS_LIBRARY, or the checkout's lib/). HEADLOSS_LIB_DIR names another folder to copy from.
"""
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        src = Path(os.environ.get("HEADLOSS_LIB_DIR", HERE.parent / "lib"))
        dst = Path(self.build_lib) / "headloss"
        lib = src / "libheadloss.so"
        if not lib.exists():
            self.announce(f"headloss: no built library in {src}; installing without one", level=3)
            return
        dst.mkdir(parents=True, exist_ok=True)
        for old in dst.glob("libheadloss*.so*"):
            old.unlink()
        # One real file under the soname: the loader's glob finds it, and the JAX adapter's
        # DT_NEEDED (libheadloss.so.0, resolved through its $ORIGIN run path) does too.
        shutil.copy2(lib.resolve(), dst / "libheadloss.so.0")
        adapter = src / "libheadloss_jax.so"
        if adapter.exists():
            shutil.copy2(adapter.resolve(), dst / "libheadloss_jax.so")
        self.announce(f"headloss: bundled the library from {src}", level=3)


setup(cmdclass={"build_py": BuildPyWithLibrary})
