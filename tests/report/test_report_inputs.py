"""What the report counts: folders that are not where their run belongs are listed as not used (never counted,
never a crash), and two evaluations that scored different items for a task are never paired."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from test_report import make_fake_runs

from hif8qat import report
from hif8qat.boundary import guarded
from hif8qat.report.sources import ItemsDiffer


def _build(runs, tmp_path):
    return report.build_report(runs, "smoke", tmp_path / "tables", tmp_path / "figures", n_boot=200, figures=False)


def _not_used(tmp_path) -> dict[str, str]:
    sources = json.loads((tmp_path / "tables" / "runs_smoke.sources.json").read_text())
    return {s["run_dir"]: s["reason"] for s in sources["runs_not_used"]}


def test_copied_and_duplicated_folders_are_listed_as_not_used_and_never_counted(tmp_path):
    runs = make_fake_runs(tmp_path / "runs", seeds=(0, 1))
    exp7 = runs / "smoke" / "exp7"
    copied = runs / "smoke" / "exp8" / "seed5"  # exp7 seed 0 copied into another experiment's seed folder
    shutil.copytree(exp7 / "seed0", copied)
    dup = exp7 / "seed0-dup"  # duplicated beside its seeds
    shutil.copytree(exp7 / "seed0", dup)
    rep = _build(runs, tmp_path)
    listed = rep["tables"]["runs_smoke"]
    assert len(listed) == 4  # exp7 and exp8 at seeds 0 and 1, nothing counted twice
    assert sorted(zip(listed["experiment"], listed["seed"])) == [("exp7", 0), ("exp7", 1), ("exp8", 0), ("exp8", 1)]
    not_used = _not_used(tmp_path)
    assert "experiment 'exp7' but it sits under 'exp8'" in not_used[str(copied)]
    assert "'seed0', but it is named 'seed0-dup'" in not_used[str(dup)]
    assert str(dup) in rep["message"] and str(copied) in rep["message"]


def test_a_tagged_run_in_its_tagged_folder_is_used(tmp_path):
    runs = make_fake_runs(tmp_path / "runs", tags={"exp8": "quant.history_len=16"})
    rep = _build(runs, tmp_path)
    assert len(rep["tables"]["runs_smoke"]) == 2 and _not_used(tmp_path) == {}


def _set_items(eval_dir, digest):
    res = json.loads((eval_dir / "results.json").read_text())
    res["_items_sha256"] = {"mini_arc": digest}
    (eval_dir / "results.json").write_text(json.dumps(res))


def test_evaluations_of_different_items_are_refused_before_anything_is_written(tmp_path, capsys):
    runs = make_fake_runs(tmp_path / "runs")
    base, other = runs / "smoke" / "exp7" / "seed0", runs / "smoke" / "exp8" / "seed0"
    _set_items(base / "eval" / "bf16", "a" * 64)
    for mode in ("bf16", "hif8"):
        _set_items(other / "eval" / mode, "a" * 64)
    _build(runs, tmp_path / "same")  # the same items: paired as before
    _set_items(other / "eval" / "hif8", "b" * 64)  # the task's data edited, then this mode evaluated again
    with pytest.raises(ItemsDiffer) as err:
        _build(runs, tmp_path / "changed")
    message = str(err.value)
    assert "mini_arc" in message and str(base / "eval" / "bf16") in message and str(other / "eval" / "hif8") in message
    assert not (tmp_path / "changed" / "tables").exists()  # nothing half-written
    assert guarded(lambda: _build(runs, tmp_path / "changed")) == 2  # an error: line, exit 2, no traceback
    assert "error: task mini_arc was scored on different items" in capsys.readouterr().err


def test_an_evaluation_without_an_item_hash_is_paired_and_the_message_says_it_is_unchecked(tmp_path):
    runs = make_fake_runs(tmp_path / "runs")
    _set_items(runs / "smoke" / "exp7" / "seed0" / "eval" / "bf16", "a" * 64)
    rep = _build(runs, tmp_path)
    assert rep["tables"]["drops_smoke"]["n_paired"].min() == 120
    assert "2 task evaluation(s) recorded no hash" in rep["message"]


def test_a_folder_whose_config_has_no_integer_seed_is_not_used(tmp_path):
    runs = make_fake_runs(tmp_path / "runs")
    cfg_path = runs / "smoke" / "exp8" / "seed0" / "config_resolved.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["seed"] = "zero"
    cfg_path.write_text(yaml.safe_dump(cfg))
    _build(runs, tmp_path)
    assert "no integer seed" in _not_used(tmp_path)[str(cfg_path.parent)]


def test_runs_with_skipped_updates_are_marked_in_the_runs_table_and_in_every_claim_that_uses_them(tmp_path):
    runs = make_fake_runs(tmp_path / "runs", seeds=(0, 1))
    marked = runs / "smoke" / "exp8" / "seed1"
    summary = json.loads((marked / "summary.json").read_text())
    (marked / "summary.json").write_text(json.dumps({**summary, "skipped_steps": 1}))
    rep = _build(runs, tmp_path)
    listed = rep["tables"]["runs_smoke"].set_index("run_dir")["skipped_updates"]
    assert listed[str(marked)] == 1 and (listed.drop(str(marked)) == 0).all()
    claims = rep["tables"]["claims_smoke"]
    uses = claims["seeds"].astype(str).str.contains("1") & (claims["experiment"] == "exp8")
    assert uses.any()
    assert (claims.loc[uses, "skipped_update_runs"] == "exp8/seed1: 1 update").all()
    assert (claims.loc[~uses, "skipped_update_runs"] == "").all()
    assert "exp8/seed1: 1 update" in rep["claims_section"] and "skipped optimizer updates" in rep["claims_section"]
