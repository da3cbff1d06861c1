"""bench/experiments/: every patch kept there still applies to the tree (`git apply --check`), so a
newcomer can run it again; a patch that no longer applies is removed (git history keeps it)."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = sorted((ROOT / "bench" / "experiments").glob("*.patch"))


def _git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    r = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True)
    return r.returncode == 0 and Path(r.stdout.strip()).resolve() == ROOT


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_patch_applies(patch):
    if not _git_checkout():
        pytest.skip("not a git checkout: git apply --check needs the repository")
    r = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"{patch.name} no longer applies (remove it or redo it):\n{r.stderr}"
