"""The mutation script's mechanics, on a list of three mutants (the whole list is for ``run_mutants.py`` itself):
a real bug from the list is killed, a change that computes the same thing survives, a snippet no longer in the
code is reported as such without running anything, and the repository is left exactly as it was."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "mutation" / "run_mutants.py"
KNOWN = "stats-relative-drop-sign"  # (base - quant) / base -> (quant - base) / base; test_relative_drop sees it


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*.py")):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def test_the_list_is_well_formed_and_its_snippets_are_in_the_code():
    mutants = yaml.safe_load((SCRIPT.parent / "mutants.yaml").read_text())
    assert len(mutants) >= 35 and len({m["id"] for m in mutants}) == len(mutants)
    areas = {m["area"] for m in mutants}
    assert {"formats", "scaling", "quant", "compute_dtype", "checkpoint", "stats", "report", "evaluate"} <= areas
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.slow  # runs the tests of two mutants in copies of the tree: half a minute
def test_a_known_mutant_is_killed_an_equivalent_one_survives_and_the_tree_is_untouched(tmp_path):
    listed = {m["id"]: m for m in yaml.safe_load((SCRIPT.parent / "mutants.yaml").read_text())}
    known = listed[KNOWN]
    mutants = [known,
               {**known, "id": "equivalent", "replacement": known["original"].replace("100.0", "100"),
                "note": "int 100: the same float result"},
               {**known, "id": "gone", "original": "this text is in no source file"}]
    assert mutants[1]["replacement"] != known["original"]
    listing = tmp_path / "mutants.yaml"
    listing.write_text(yaml.safe_dump(mutants))
    before = _digest(ROOT / "src")

    done = subprocess.run([sys.executable, str(SCRIPT), "--mutants", str(listing), "--json", str(tmp_path / "r.json"),
                           "--timeout", "300"], capture_output=True, text=True, timeout=900)

    assert _digest(ROOT / "src") == before, "the repository's sources were left changed"
    results = {r["id"]: r["status"] for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert results == {KNOWN: "killed", "equivalent": "survived", "gone": "snippet not found"}, done.stdout[-3000:]
    assert "score: 1/2 killed (50.0 %)" in done.stdout
    assert done.returncode == 1  # under the minimum score, and a snippet not found
