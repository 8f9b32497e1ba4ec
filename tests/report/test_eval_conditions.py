"""The report compares two evaluations only when they were made alike: which recorded conditions count
(hand-written ``_meta`` blocks), and the tables, claims and message of a report whose baseline was evaluated
differently from its quantized run."""

import ast
import copy
import json
import math
import shutil
from pathlib import Path

import pytest
from test_report import make_fake_runs, record_eval_files

from hif8qat import report
from hif8qat.report.conditions import CONDITION_KEYS, NOT_CONDITION_KEYS, evaluation_differences

ROOT = Path(__file__).resolve().parents[2]

# An evaluation's _meta as the evaluation writes it, written out by hand (two tasks, a subset of each).
META = {
    "mode": "bf16", "dtype": "float32", "device": "cpu", "autocast": "bfloat16",
    "numerics": {"numerics": "bf16", "device_type": "cpu", "native_bf16": True, "cpu_capability": "AVX512"},
    "batch_size": 32, "limit": None, "seed": 1234, "wall_time_s": 88.5,
    "tasks": {"hellaswag": {"metric": "acc_norm", "filter": "none", "num_fewshot": 0, "mini": False},
              "arc_challenge": {"metric": "acc_norm", "filter": "none", "num_fewshot": 0, "mini": False}},
    "local_datasets": {}, "data_root": "$HIF8QAT_CACHE/evaldata/v1",
    "subset": {"hellaswag": {"size": 130, "of": 10042, "subtasks": 1, "seed": 0},
               "arc_challenge": {"size": 200, "of": 1172, "subtasks": 1, "seed": 0}},
    "subset_seed": 0, "eval_tokens": {"forwarded": 47188}, "ranks": 1, "lm_eval_version": "0.4.13",
    "provenance": {"git": {"commit": "abc", "dirty": False}}, "run_dir": "mini/exp1/seed0",
    "export_dir": "mini/exp1/seed0/export", "paths_relative_to": "results_root",
}


def _meta(**changes):
    """META with dotted changes applied ("tasks.hellaswag.num_fewshot": 10); a value of ... deletes the key."""
    meta = copy.deepcopy(META)
    for dotted, value in changes.items():
        *path, last = dotted.split(".")
        node = meta
        for key in path:
            node = node[key]
        if value is ...:
            del node[last]
        else:
            node[last] = value
    return meta


def test_alike_evaluations_differ_in_nothing_whatever_they_record_besides():
    other = _meta(**{"mode": "hif8", "quant": {"format": "hif8"}, "wall_time_s": 12.0, "ranks": 2,
                     "provenance": {"git": {"commit": "def"}}, "eval_tokens": {"forwarded": 1},
                     "run_dir": "mini/exp3/seed0", "export_dir": "mini/exp3/seed0/export",
                     "numerics.cpu_capability": "AVX2", "device": "cpu:0"})
    assert evaluation_differences(META, other) == []


@pytest.mark.parametrize(("a", "b", "expected"), [
    ({"scoring": "packed"}, {}, ["scoring: packed vs cached"]),  # no key: recorded before packing, scored cached
    ({}, {"scoring": "packed"}, ["scoring: cached vs packed"]),
    ({"scoring": "cached"}, {}, []),
    ({"tasks.hellaswag.num_fewshot": 10}, {}, ["hellaswag num_fewshot: 10 vs 0"]),
    ({"batch_size": 16}, {}, ["batch_size: 16 vs 32"]),
    ({"subset.arc_challenge.size": 100}, {},
     ["arc_challenge subset: 100 of 1172 items (seed 0) vs 200 of 1172 items (seed 0)"]),
    ({"subset.hellaswag.seed": 1}, {},
     ["hellaswag subset: 130 of 10042 items (seed 1) vs 130 of 10042 items (seed 0)"]),
    ({"subset.hellaswag": ...}, {}, ["hellaswag subset: all items vs 130 of 10042 items (seed 0)"]),
    ({"lm_eval_version": "0.4.9"}, {}, ["lm_eval_version: 0.4.9 vs 0.4.13"]),
    ({"local_datasets": {"arc_challenge": "/data/arc"}}, {},
     ["arc_challenge data: /data/arc vs $HIF8QAT_CACHE/evaldata/v1"]),
    ({"numerics.numerics": "bf16_emulated", "numerics.native_bf16": False}, {},
     ["numerics: bf16_emulated vs bf16", "native_bf16: False vs True"]),
    ({"dtype": "bfloat16", "limit": 50, "seed": 0}, {}, ["dtype: bfloat16 vs float32", "limit: 50 vs none",
                                                          "seed: 0 vs 1234"]),
    # recorded before the key existed: its value then is not known, so it is not held against the other
    ({"lm_eval_version": ..., "subset": ..., "numerics": ..., "data_root": ...}, {}, []),
    ({"numerics": ..., "autocast": None}, {"numerics": ...}, ["autocast: none vs bfloat16"]),
    ({"numerics": ..., "autocast": None}, {}, ["autocast: none vs bfloat16"]),
    ({"numerics.numerics": "none", "autocast": None}, {}, ["numerics: none vs bf16"]),  # one line for one cause
])
def test_each_differing_condition_is_named_as_a_setting(a, b, expected):
    assert sorted(evaluation_differences(_meta(**a), _meta(**b))) == sorted(expected)


def test_a_task_is_compared_on_its_own_conditions_and_the_evaluation_wide_ones():
    shots = _meta(**{"tasks.hellaswag.num_fewshot": 10})
    assert evaluation_differences(META, shots, ["arc_challenge"]) == []
    assert evaluation_differences(META, shots, ["hellaswag"]) == ["hellaswag num_fewshot: 0 vs 10"]
    packed = _meta(scoring="packed")
    assert evaluation_differences(META, packed, ["arc_challenge"]) == ["scoring: cached vs packed"]


def test_a_task_read_from_another_path_counts_only_where_no_item_hash_shows_the_same_items():
    here, there = _meta(), _meta(**{"local_datasets": {"hellaswag": "/scratch/b/hellaswag"}})
    same = {"hellaswag": "ab12", "arc_challenge": "cd34"}
    assert evaluation_differences({"_meta": here, "_items_sha256": same},
                                  {"_meta": there, "_items_sha256": dict(same)}) == []
    moved = ["hellaswag data: $HIF8QAT_CACHE/evaldata/v1 vs /scratch/b/hellaswag"]
    assert evaluation_differences({"_meta": here, "_items_sha256": same},
                                  {"_meta": there, "_items_sha256": {**same, "hellaswag": "ef56"}}) == moved
    assert evaluation_differences({"_meta": here}, {"_meta": there, "_items_sha256": same}) == moved
    assert evaluation_differences(here, there) == moved  # _meta blocks alone record no item hash


def _meta_keys_the_evaluation_writes() -> set[str]:
    """The top-level keys the evaluation's source gives the dict it names ``meta`` (its _meta): in the dict literal
    assigned to it (``**{...}`` unpacked into it included) and in ``meta["key"] = ...``."""
    def literal_keys(d: ast.Dict) -> set[str]:
        keys = {k.value for k in d.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        for k, v in zip(d.keys, d.values):
            if k is None:  # **{...} or **({...} if ... else {})
                keys |= {s for sub in ast.walk(v) if isinstance(sub, ast.Dict) for s in literal_keys(sub)}
        return keys

    keys = set()
    for path in (ROOT / "src" / "hif8qat" / "evaluate").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == "meta" and isinstance(node.value, ast.Dict):
                    keys |= literal_keys(node.value)
                if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                        and target.value.id == "meta" and isinstance(target.slice, ast.Constant)):
                    keys.add(target.slice.value)
    return keys


def test_every_key_an_evaluation_records_is_decided_a_condition_or_not():
    written = _meta_keys_the_evaluation_writes()
    # the reader finds the block, its unpacked part and the quantized mode's key
    assert {"scoring", "tasks", "batch_size", "mode", "wall_time_s", "eval_tokens_by_rank", "quant"} <= written
    assert not CONDITION_KEYS & NOT_CONDITION_KEYS
    assert written <= CONDITION_KEYS | NOT_CONDITION_KEYS


def test_the_committed_reference_evaluations_are_all_alike():
    metas = [json.loads(p.read_text())["_meta"] for p in
             sorted((ROOT / "results" / "reference_runs" / "mini").glob("*/seed*/eval/*/results.json"))]
    assert len(metas) > 10 and all("scoring" not in m for m in metas)
    assert all(evaluation_differences(metas[0], m) == [] for m in metas[1:])


# ------------------------------------------------------------------------------------------ the report
def _set_meta(eval_dir: Path, meta: dict) -> None:
    doc = json.loads((eval_dir / "results.json").read_text())
    doc["_meta"] = {**meta, "mode": eval_dir.name}
    (eval_dir / "results.json").write_text(json.dumps(doc))


def _runs(tmp_path: Path, baseline: dict, run_bf16: dict, run_hif8: dict) -> Path:
    runs = make_fake_runs(tmp_path / "runs")
    _set_meta(runs / "smoke" / "exp7" / "seed0" / "eval" / "bf16", baseline)
    _set_meta(runs / "smoke" / "exp8" / "seed0" / "eval" / "bf16", run_bf16)
    _set_meta(runs / "smoke" / "exp8" / "seed0" / "eval" / "hif8", run_hif8)
    return record_eval_files(runs)


def _task_meta(**changes):
    """A one-task (mini_arc, the fake runs' task) _meta, as an evaluation before `scoring` existed wrote it."""
    meta = _meta(**{"tasks": {"mini_arc": {"metric": "acc_norm", "filter": "none", "num_fewshot": 0, "mini": True}},
                    "subset": {}})
    return {**meta, **changes}


def test_alike_evaluations_are_compared_as_before(tmp_path):
    runs = _runs(tmp_path, _task_meta(), _task_meta(scoring="cached"), _task_meta(wall_time_s=1.0, ranks=2))
    rep = report.build_report(runs, "smoke", tmp_path / "t", tmp_path / "f", n_boot=100, figures=False)
    drops = rep["tables"]["drops_smoke"].set_index("quant_mode")
    n_right = round(drops.loc["bf16", "base_pct"] * 120 / 100)  # the baseline's right answers of 120
    # the fake quantized run loses 6 (bf16 mode) and 20 (hif8 mode) of them
    assert drops.loc["bf16", "drop_pct"] == pytest.approx(6 / n_right * 100)
    assert drops.loc["hif8", "drop_pct"] == pytest.approx(20 / n_right * 100)
    assert list(drops["eval_differs"]) == ["", ""] and (drops["n_paired"] == 120).all()
    assert "not compared" not in rep["message"]
    claims = rep["tables"]["claims_smoke"]
    assert ((claims.metric == "accuracy") & (claims.against == "baseline")).sum() == 2


def test_an_evaluation_scored_packed_is_not_compared_with_one_recorded_before_scoring(tmp_path):
    runs = _runs(tmp_path, _task_meta(), _task_meta(scoring="packed"), _task_meta(scoring="packed"))
    shutil.copytree(runs / "smoke" / "exp7" / "seed0" / "eval" / "bf16", tmp_path / "base_model" / "smoke")
    rep = report.build_report(runs, "smoke", tmp_path / "t", tmp_path / "f", n_boot=100, figures=False)
    t = rep["tables"]
    drops = t["drops_smoke"]
    assert len(drops) == 2 and drops["drop_pct"].isna().all() and drops["ci_lo"].isna().all()
    assert (drops["eval_differs"] == "scoring: cached vs packed").all()
    assert not math.isnan(drops["base_pct"].iloc[0])  # the scores themselves stay
    abl = t["ablations_smoke"].iloc[0]
    assert math.isnan(abl["drop_pct"]) and abl["eval_differs"] == "scoring: cached vs packed"
    vs_base = t["vs_base_smoke"].set_index("experiment")
    assert vs_base.loc["exp7", "eval_differs"] == "" and vs_base.loc["exp7", "drop_pct"] == 0
    assert math.isnan(vs_base.loc["exp8", "drop_pct"]) and "scoring" in vs_base.loc["exp8", "eval_differs"]
    # no claim pools the seed: the accuracy of exp8 against exp7 is not claimed at all; its own hif8 against
    # its own bf16 (both packed) still is
    acc = t["claims_smoke"][t["claims_smoke"].metric == "accuracy"]
    assert set(acc.against) == {"bf16_mode"}
    assert "not compared, evaluated differently" in rep["message"]
    assert "exp7/seed0 bf16 vs exp8/seed0 hif8 (mini_arc): scoring: cached vs packed" in rep["message"]
    assert "base model bf16 vs exp7/seed0" not in rep["message"]  # alike
    assert "base model bf16 vs exp8/seed0 bf16 (mini_arc): scoring: cached vs packed" in rep["message"]
    assert "stage=eval force=true" in rep["message"]
    assert "eval_differs" in json.loads((tmp_path / "t" / "drops_smoke.sources.json").read_text())["note"]


def test_differing_shots_or_subset_leave_out_only_the_comparisons_they_touch(tmp_path):
    subset = {"mini_arc": {"size": 60, "of": 120, "subtasks": 1, "seed": 0}}
    runs = _runs(tmp_path, _task_meta(subset=subset), _task_meta(subset=subset),
                 _task_meta(subset={"mini_arc": {**subset["mini_arc"], "seed": 3}}))
    drops = report.build_report(runs, "smoke", tmp_path / "t", tmp_path / "f", n_boot=100,
                                figures=False)["tables"]["drops_smoke"].set_index("quant_mode")
    assert drops.loc["bf16", "eval_differs"] == "" and drops.loc["bf16", "drop_pct"] > 0
    assert drops.loc["hif8", "eval_differs"] == ("mini_arc subset: 60 of 120 items (seed 0) vs 60 of 120 items "
                                                 "(seed 3)") and math.isnan(drops.loc["hif8", "drop_pct"])
    shots = _task_meta()
    shots["tasks"] = {"mini_arc": {**shots["tasks"]["mini_arc"], "num_fewshot": 5}}
    runs = _runs(tmp_path / "b", _task_meta(), shots, _task_meta())
    rep = report.build_report(runs, "smoke", tmp_path / "t", tmp_path / "f", n_boot=100, figures=False)
    drops = rep["tables"]["drops_smoke"].set_index("quant_mode")
    assert drops.loc["bf16", "eval_differs"] == "mini_arc num_fewshot: 0 vs 5"
    assert math.isnan(drops.loc["bf16", "drop_pct"]) and drops.loc["hif8", "drop_pct"] > 0
    # the run's hif8 mode (0 shots) against its own bf16 mode (5 shots): no claim either
    assert "exp8/seed0 bf16 vs exp8/seed0 hif8 (mini_arc): mini_arc num_fewshot: 5 vs 0" in rep["message"]
