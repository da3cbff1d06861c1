"""The Python side of the ABI (headloss/_abi.py, generated from include/headloss.h by
tools/gen_abi.py) against the C compiler: every structure's size and every field's offset, every
#define and enumerator, the INIT macros' defaults, and the library's scalar names."""
import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from headloss import _abi
from headloss._lib import lib
from headloss.loss import SCALARS

ROOT = Path(__file__).resolve().parents[2]


def _constants():
    return {k: v for k, v in vars(_abi).items() if k.startswith("HL_") and isinstance(v, int)}


def _program() -> str:
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "headloss.h"', "int main(void) {"]
    for s in _abi.STRUCTS:
        n = s.__name__
        lines.append(f'  printf("{n} %zu\\n", sizeof({n}));')
        lines += [f'  printf("{n}.{f} %zu\\n", offsetof({n}, {f}));' for f, _ in s._fields_]
        if s._defaults_:
            init = n.replace("hl_", "HL_", 1).upper()[:-2] + "_INIT"
            lines.append(f"  {{ {n} d = {init};")
            lines += [f'    printf("{n}={f} %.9g\\n", (double)d.{f});' for f in s._defaults_]
            lines.append("  }")
    lines += [f'  printf("{k} %lld\\n", (long long)({k}));' for k in _constants()]
    return "\n".join(lines + ["  return 0;", "}"])


@pytest.fixture(scope="module")
def c_abi(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or clang) to compare the ctypes layouts with")
    d = tmp_path_factory.mktemp("abi")
    (d / "abi.c").write_text(_program())
    subprocess.run([cc, "-std=c99", "-I", str(ROOT / "include"), str(d / "abi.c"), "-o", str(d / "abi")],
                   check=True, capture_output=True)
    out = subprocess.run([str(d / "abi")], check=True, capture_output=True, text=True).stdout
    return dict(line.rsplit(" ", 1) for line in out.splitlines())


@pytest.mark.parametrize("struct", _abi.STRUCTS, ids=lambda s: s.__name__)
def test_struct_layout_matches_c(c_abi, struct):
    n = struct.__name__
    assert ctypes.sizeof(struct) == int(c_abi[n]), n
    for f, _ in struct._fields_:
        assert getattr(struct, f).offset == int(c_abi[f"{n}.{f}"]), f"{n}.{f}"


def test_init_defaults_match_c(c_abi):
    for s in _abi.STRUCTS:
        for f, v in s._defaults_.items():
            assert float(c_abi[f"{s.__name__}={f}"]) == pytest.approx(v, rel=1e-7), f


def test_constants_match_c(c_abi):
    consts = _constants()
    assert {"HL_VERSION", "HL_LOSS_CE", "HL_DTYPE_BF16", "HL_LOSS_NUM_SCALARS"} <= set(consts)
    for k, v in consts.items():
        assert int(c_abi[k]) == v, k


def test_scalar_names_are_the_library_s():
    lib.hl_loss_scalar_name.restype = ctypes.c_char_p
    lib.hl_loss_scalar_name.argtypes = [ctypes.c_int]
    names = [lib.hl_loss_scalar_name(i).decode() for i in range(_abi.HL_LOSS_NUM_SCALARS)]
    assert tuple(names) == SCALARS and lib.hl_loss_scalar_name(len(names)) is None


def test_generated_module_is_the_header_s(tmp_path):
    """The _abi.py imported is what the generator makes of this header (not a stale build)."""
    out = tmp_path / "_abi.py"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_abi.py"), str(ROOT / "include" / "headloss.h"),
                    "-o", str(out)], check=True)
    assert out.read_text() == Path(_abi.__file__).read_text()
