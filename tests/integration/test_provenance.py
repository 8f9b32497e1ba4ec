"""Provenance of what a run reads back: appended logs accept a cut line only where a killed writer leaves it
(the last line), and a wrongly typed record is named, never plotted or summed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hif8qat.cli import stages
from hif8qat.errors import RunError

GOOD = [{"step": s, "loss": 2.0 - 0.1 * s, "lr": 1e-4, "grad_norm": 1.0, "tokens": 64 * (s + 1)} for s in range(4)]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _lines() -> list[str]:
    return [json.dumps(r) for r in GOOD]


@pytest.fixture
def cut_middle(tmp_path) -> Path:
    lines = _lines()
    lines[1] = lines[1][:12]  # a cut line followed by more: not what a killed writer leaves
    return _write(tmp_path / "metrics.jsonl", lines)


def test_a_cut_last_line_of_the_step_log_is_dropped(tmp_path):
    from hif8qat.report.sources import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(line + "\n" for line in _lines()) + '{"step": 4, "lo')
    assert list(read_metrics(path)["step"]) == [0, 1, 2, 3]


def test_a_cut_line_in_the_middle_of_the_step_log_is_an_error_in_the_report(cut_middle):
    from hif8qat.report.sources import read_metrics

    with pytest.raises(RunError, match=r"metrics.jsonl is unreadable \(line 2 does not parse"):
        read_metrics(cut_middle)


def test_a_cut_line_in_the_middle_of_the_step_log_is_an_error_on_resume(cut_middle):
    from hif8qat.train.log import truncate_metrics

    before = cut_middle.read_text()
    with pytest.raises(RunError, match=r"metrics.jsonl is unreadable \(line 2 does not parse"):
        truncate_metrics(cut_middle, 3)
    assert cut_middle.read_text() == before  # nothing rewritten


def test_a_cut_line_in_the_middle_of_the_step_log_is_an_error_in_the_summary(cut_middle):
    from hif8qat.train.log import train_summary

    with pytest.raises(RunError, match=r"line 2 does not parse"):
        train_summary(cut_middle, {False: [], True: []}, 1.0, [], 1.0)


@pytest.mark.parametrize("field,value", [("loss", "abc"), ("step", "3"), ("lr", None), ("tokens", 1.5)])
def test_a_wrongly_typed_step_record_is_named(tmp_path, field, value):
    from hif8qat.report.sources import read_metrics

    records = [dict(r) for r in GOOD]
    records[2][field] = value
    path = _write(tmp_path / "metrics.jsonl", [json.dumps(r) for r in records])
    with pytest.raises(RunError, match=rf"line 3: {field} is"):
        read_metrics(path)


def test_a_cut_line_in_the_middle_of_a_telemetry_dump_is_an_error(tmp_path):
    from hif8qat.files import replace_step_records
    from hif8qat.report.sources import read_telemetry_dumps

    folder = tmp_path / "telemetry"
    folder.mkdir()
    lines = [json.dumps({"step": s, "layer": "l0", "amax": 1.0}) for s in range(3)]
    _write(folder / "scales.jsonl", [lines[0], lines[1][:9], lines[2]])
    with pytest.raises(RunError, match=r"scales.jsonl is unreadable \(line 2 does not parse"):
        read_telemetry_dumps(tmp_path)
    with pytest.raises(RunError, match=r"scales.jsonl is unreadable \(line 2 does not parse"):
        replace_step_records(folder / "scales.jsonl", [json.dumps({"step": 3, "layer": "l0", "amax": 2.0})])
    _write(folder / "scales.jsonl", [lines[0], lines[1], lines[2][:9]])  # cut last line: a killed writer's
    assert list(read_telemetry_dumps(tmp_path)["step"]) == [0, 1]


@pytest.fixture(scope="module")
def quant_export(tmp_path_factory) -> Path:
    from test_checkpoint import _smoke

    from hif8qat.train.loop import train

    root = tmp_path_factory.mktemp("export")
    (root / "run").mkdir()
    train(_smoke(root, "train.keep_checkpoints_when_done=0", experiment="exp3"), root / "run")
    return root / "run" / "export"


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[-1] ^= 1
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "hif8qat_quant.json"])
@pytest.mark.parametrize("recorded", [True, False], ids=["hashes", "no-hashes"])
def test_a_damaged_export_file_is_named_when_evaluation_reads_it(quant_export, tmp_path, name, recorded):
    import shutil

    from hif8qat.artefacts import FOLDER_MANIFEST, UnverifiedArtefact, trusting_unverified
    from hif8qat.evaluate.loading import load_for_eval

    export = tmp_path / "export"
    shutil.copytree(quant_export, export)
    load_for_eval(export, "hif8")  # intact: loads
    if not recorded:  # an export written before exports recorded hashes: unverified, so refused as it is
        (export / FOLDER_MANIFEST).unlink()
        with pytest.raises(UnverifiedArtefact, match=rf"{export} is unverified \(it has no {FOLDER_MANIFEST}\)"):
            load_for_eval(export, "hif8")
    _damage(export / name, "flip" if recorded else "cut")
    with pytest.raises(RunError, match=(rf"{name} is unreadable \(sha256" if recorded else
                                        rf"{export} is unreadable")), trusting_unverified(not recorded):
        load_for_eval(export, "hif8")  # trusted without hashes: its loaders' errors are named instead


# ------------------------------------------------------------------ one schema per kind of document
RESULT = {"metric": "acc", "value": 0.5, "stderr": 0.1, "n": 10, "num_fewshot": 0}


def _eval_mode(tmp_path: Path, **changes) -> Path:
    from hif8qat.evaluate.outputs import write_eval_dir

    out = tmp_path / "eval" / "hif8"
    write_eval_dir(out, {"mini_arc": dict(RESULT), "_meta": {"mode": "hif8"}}, {}, None)
    doc = json.loads((out / "results.json").read_text())
    for key, value in changes.items():
        doc[key] = value
    (out / "results.json").write_text(json.dumps(doc))
    return out


@pytest.mark.parametrize("changes,field", [
    ({"mini_arc": {**RESULT, "value": "0.5"}}, "mini_arc.value"),
    ({"mini_arc": [0.5, 0.1]}, r"mini_arc is \[0.5, 0.1\], not an object"),
    ({"_files": "abc"}, "_files is"),
], ids=["value-as-string", "task-as-list", "files-as-string"])
def test_a_wrongly_typed_results_file_is_redone_by_the_eval_stage_and_named_by_the_report(
        tmp_path, changes, field, capsys):

    from hif8qat.report.sources import eval_results

    out = _eval_mode(tmp_path)
    assert stages._mode_done(out)  # intact: done
    out = _eval_mode(tmp_path, **changes)
    assert not stages._mode_done(out)  # stage=eval evaluates the mode again
    assert "evaluating hif8 again" in capsys.readouterr().out
    with pytest.raises(RunError, match=rf"results.json is unreadable \({field}"):
        eval_results(types_run(tmp_path), "hif8")


def types_run(path: Path):
    import types

    return types.SimpleNamespace(path=path)


def test_a_wrongly_typed_heldout_summary_field_is_named(tmp_path):
    from hif8qat.stats.heldout import SUMMARY_FILE, heldout_dir, read_summary

    folder = heldout_dir(tmp_path)
    folder.mkdir(parents=True)
    summary = {"pct": {"mean": 0.1, "var": 0.01, "n_windows": 8}, "n_tokens": 100, "nll_ref": 3.0,
               "nll_diff": {"mean": 0.01}, "kl": {"mean": 0.001, "p99": 0.01}, "top1": {"mean": 0.99}}
    summary["nll_diff_pct"] = summary.pop("pct")
    doc = {"comparisons": {"hif8_vs_bf16": {"reference": "bf16", "other": "hif8", "summary": summary}}}
    (folder / SUMMARY_FILE).write_text(json.dumps(doc))
    assert read_summary(tmp_path)["comparisons"]
    summary["nll_diff_pct"]["n_windows"] = "eight"
    (folder / SUMMARY_FILE).write_text(json.dumps(doc))
    with pytest.raises(RunError, match=r"summary.json is unreadable \(comparisons.hif8_vs_bf16.summary."
                                       r"nll_diff_pct.n_windows is \"eight\", not an integer"):
        read_summary(tmp_path)


def test_a_run_info_whose_history_is_not_a_list_is_named(tmp_path):
    from hif8qat.runs.folders import CorruptRunFile, _read_run_info

    path = tmp_path / "run_info.json"
    path.write_text(json.dumps({"history": 5}))
    with pytest.raises(CorruptRunFile, match="history is 5, not a list"):
        _read_run_info(path)
