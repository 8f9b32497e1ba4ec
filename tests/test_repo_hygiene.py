"""What a fresh clone holds: nothing a user's run would mistake for its own."""

import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _tracked(path: str) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "--", path], cwd=REPO, capture_output=True, text=True,
                             check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return out.split()


def test_default_results_root_is_untracked():
    # A tracked run folder makes a fresh clone's `make exp3` take the committed baseline as finished.
    default_root = yaml.safe_load((REPO / "conf" / "config.yaml").read_text())["results_root"]
    tracked = _tracked(default_root)
    assert tracked == [], f"{len(tracked)} files under {default_root} are tracked, e.g. {tracked[:3]}"


def test_default_results_root_is_ignored():
    default_root = yaml.safe_load((REPO / "conf" / "config.yaml").read_text())["results_root"]
    probe = f"{default_root}/mini/exp1/seed0/summary.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", probe], cwd=REPO, timeout=30)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0, f"{probe} is not ignored: a user's results could be committed"


def test_smoke_tables_are_never_committed():
    # CI runs `make exp3 PROFILE=smoke` on the clean checkout: its report must not rewrite tracked files.
    tracked = _tracked("results/tables/smoke") + _tracked("results/figures/smoke")
    assert tracked == [], tracked[:3]


def test_test_modules_have_unique_basenames():
    """The test folders are not packages: pytest imports each module by its basename, so a second file of the same
    name (tests/runs/x.py beside tests/integration/x.py) stops the whole suite's collection, which a run of one
    folder never shows."""
    tests = Path(__file__).resolve().parent
    seen: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        if not (path.parent / "__init__.py").exists():
            seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}
