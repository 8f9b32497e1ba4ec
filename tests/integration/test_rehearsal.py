"""`make rehearse`: the paper profile's code path on CPU, with only sizes and device changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.rehearsal
def test_the_paper_path_rehearsal_passes_every_check(tmp_path):
    work = tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "hif8qat.rehearse.paper_path", "--work", str(work)],
                         capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    result = json.loads((work / "checks.json").read_text())
    failed = {name: why for name, why in result["checks"].items() if why}
    assert out.returncode == 0 and not failed, f"{failed}\n{out.stdout[-4000:]}\n{out.stderr[-2000:]}"
    # what a user of a paper run checks (each is one of the rehearsal's checks)
    assert set(result["checks"]) >= {
        "whole_run_finished", "evaluation_in_both_modes_on_both_ranks", "sharded_evaluation_equals_one_process",
        "telemetry_dumps_hold_their_steps", "identical_parameters_on_all_ranks",
        "grad_norm_equals_the_unsharded_one", "data_never_duplicated_across_ranks", "epoch_wraps_logged",
        "kill_and_resume_equal_the_uninterrupted_run", "resume_on_one_rank_continues_the_saved_state",
        "resume_on_one_rank_reads_no_document_twice", "report_builds"}
    assert result["wall_s"] < 600


def test_the_replay_probe_splits_the_documents_between_ranks_and_measures_a_gradient(tmp_path):
    # The probe the rehearsal's data and gradient-norm checks lean on, run as the rehearsal runs it.
    from hif8qat.rehearse.standins import write_fineweb_shards, write_remote_code_model

    model = write_remote_code_model(tmp_path / "tiny_pangu_probe", num_layers=1)
    write_fineweb_shards(tmp_path / "fineweb", shards=3, docs_per_shard=3, row_group_size=1)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    sizes = ["--world", "2", "--accum", "1", "--seq-len", "16", "--micro-batch", "2", "--steps", "4",
             "--resume-at", "2"]
    out = subprocess.run([sys.executable, "-m", "hif8qat.rehearse.probes", "replay", str(model),
                          str(tmp_path / "fineweb"), *sizes], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    docs = answer["docs"]
    assert len(docs) == 2 and all(docs), docs
    assert sorted(docs[0] + docs[1]) == sorted(f"{s}-{i}" for s in range(3) for i in range(3))
    assert answer["decoded"] == [len(d) for d in docs]  # one row per row group: no rank decodes another's
    assert answer["grad_norm"] > 0


def test_no_module_runs_python_code_kept_in_a_string():
    # Code handed to `python -c` is invisible to imports, linters and the layout test: a module run with -m is not.
    import ast

    found = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.List) and len(node.elts) > 1 and ast.unparse(node.elts[0]) == "sys.executable" \
                    and isinstance(node.elts[1], ast.Constant) and node.elts[1].value == "-c":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"python -c with code in a string: {found}"
