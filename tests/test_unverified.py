"""Absent is unverified: a result file, an export or a checkpoint whose integrity record is missing or leaves a
file out is refused with one ``error:`` line naming it and what to do, and the files are left as they were;
trust_unverified=true uses it anyway, and the report then names it beside every row built from it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_reliability import assert_user_error, cli
from test_report import make_fake_runs

from hif8qat import artefacts
from hif8qat.artefacts import FOLDER_MANIFEST, UnverifiedArtefact, trusting_unverified, write_folder_manifest
from hif8qat.boundary import guarded
from hif8qat.errors import RunError
from hif8qat.evaluate.loading import load_for_eval
from hif8qat.report.sources import eval_results, read_samples
from hif8qat.stats.heldout import read_summary

ONE_THREAD = True


def tree(root: Path) -> dict[str, str | None]:
    """Every path under ``root`` with its content's sha256 (None for a folder): what a refusal must not change."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(Path(root).rglob("*"))}


def _drop_files_record(results: Path) -> None:
    doc = json.loads(results.read_text())
    del doc["_files"]
    results.write_text(json.dumps(doc))


def _edit_samples(samples: Path) -> None:
    """A whole, well-formed CSV whose answers were changed: every correct answer made wrong."""
    lines = samples.read_text().splitlines()
    samples.write_text("\n".join([lines[0]] + [line.replace(",1", ",0", 1) for line in lines[1:]]) + "\n")


# ------------------------------------------------------------------ G07: results.json without _files
@pytest.fixture
def unrecorded_runs(tmp_path):
    """exp7 and exp8 run folders where exp8's hif8 results.json has no _files and its samples were edited."""
    runs_root = make_fake_runs(tmp_path / "runs", exps=("exp7", "exp8"))
    mode = runs_root / "smoke" / "exp8" / "seed0" / "eval" / "hif8"
    _drop_files_record(mode / "results.json")
    _edit_samples(mode / "samples_mini_arc.csv")
    return runs_root, mode


def test_report_refuses_results_without_a_files_record_and_leaves_the_tree(unrecorded_runs):
    runs_root, mode = unrecorded_runs
    before = tree(runs_root.parent)
    out = cli(["experiment=exp8", "stage=report"], runs_root)
    assert_user_error(out, f"{mode / 'results.json'} is unverified", "no _files record", "trust_unverified=true",
                      "stage=eval")
    assert len([line for line in out.stderr.splitlines() if line.startswith("error:")]) == 1
    assert tree(runs_root.parent) == before  # no table, no figure, nothing changed


def test_trusted_report_marks_every_row_from_the_unverified_file(unrecorded_runs):
    runs_root, mode = unrecorded_runs
    out = cli(["experiment=exp8", "stage=report", "trust_unverified=true"], runs_root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "used without an integrity record" in out.stdout and str(mode / "results.json") in out.stdout
    tables = runs_root / "tables" / "smoke"
    drops = (tables / "drops_smoke.csv").read_text().splitlines()
    header = drops[0].split(",")
    assert "unverified" in header
    hif8 = [row for row in drops[1:] if ",hif8," in row]
    assert hif8 and all(str(mode / "results.json") in row for row in hif8)  # each number from it is named
    claims = (tables / "claims_smoke.csv").read_text()
    assert str(mode / "results.json") in claims
    sources = json.loads((tables / "drops_smoke.sources.json").read_text())
    assert str(mode / "results.json") in sources["unverified"]
    section = (tables / "claims_section_smoke.md").read_text()
    assert section.startswith("> **Unverified inputs**") and str(mode / "results.json") in section.splitlines()[0]


def test_a_files_record_that_leaves_out_a_file_beside_it_is_unverified(tmp_path):
    runs_root = make_fake_runs(tmp_path / "runs", exps=("exp7",))
    mode = runs_root / "smoke" / "exp7" / "seed0" / "eval" / "bf16"
    shutil.copy(mode / "samples_mini_arc.csv", mode / "samples_mini_hellaswag.csv")  # written after the record
    run = type("Run", (), {"path": mode.parent.parent})()
    with pytest.raises(UnverifiedArtefact, match="does not list samples_mini_hellaswag.csv, which is there"):
        eval_results(run, "bf16")
    with trusting_unverified(True) as accepted:
        assert eval_results(run, "bf16")["mini_arc"]["n"] == 120
    assert list(accepted) == [str(mode / "results.json")]


def test_an_edited_csv_is_refused_through_its_recorded_hash(tmp_path):
    runs_root = make_fake_runs(tmp_path / "runs", exps=("exp7",))
    samples = runs_root / "smoke" / "exp7" / "seed0" / "eval" / "bf16" / "samples_mini_arc.csv"
    recorded = json.loads((samples.parent / "results.json").read_text())["_files"][samples.name]
    assert read_samples(samples)["correct"].sum() > 0  # the control: as written, it reads
    artefacts.read_csv(samples, "redo", sha256=recorded)
    _edit_samples(samples)
    with pytest.raises(RunError, match=r"sha256 .* differs"):
        artefacts.read_csv(samples, "redo", sha256=recorded)  # well-formed: only the hash sees the edit
    with pytest.raises(RunError, match=rf"{samples.name} is unreadable \(sha256"):
        read_samples(samples)


def test_samples_with_no_results_beside_them_are_unverified(tmp_path):
    runs_root = make_fake_runs(tmp_path / "runs", exps=("exp7",))
    mode = runs_root / "smoke" / "exp7" / "seed0" / "eval" / "bf16"
    (mode / "results.json").unlink()
    with pytest.raises(UnverifiedArtefact, match="no results.json beside it"):
        read_samples(mode / "samples_mini_arc.csv")


def test_a_heldout_summary_without_the_tokens_hash_is_unverified(tmp_path):
    d = tmp_path / "run" / "eval" / "heldout"
    d.mkdir(parents=True)
    (d / "tokens.csv.gz").write_bytes(b"not read")
    (d / "summary.json").write_text(json.dumps({"models": {}, "tokens_file": "tokens.csv.gz"}))
    with pytest.raises(UnverifiedArtefact, match="records no tokens_sha256"):
        read_summary(tmp_path / "run")
    with trusting_unverified(True) as accepted:
        assert read_summary(tmp_path / "run")["tokens_file"] == "tokens.csv.gz"
    assert list(accepted) == [str(d / "tokens.csv.gz")]


# ------------------------------------------------------------------ G08, B07: an export's manifest
@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from conftest import write_quantized_export

    folder = tmp_path_factory.mktemp("export") / "export"
    folder.mkdir()
    write_quantized_export(folder, scope="mlp", seed=0)
    write_folder_manifest(folder)
    return folder


def _corrupt_floats(path: Path) -> None:
    """One high byte set in every 997th float of a safetensors file's data (its header left whole)."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    for i in range(start + 3, len(data), 4 * 997):
        data[i] ^= 0x40
    path.write_bytes(bytes(data))


def test_an_export_without_its_manifest_is_refused_not_evaluated(export, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(export, folder)
    load_for_eval(folder, "hif8")  # the control: whole, it loads
    (folder / FOLDER_MANIFEST).unlink()
    _corrupt_floats(folder / "model.safetensors")
    before = tree(tmp_path)
    messages = []
    status = guarded(lambda: load_for_eval(folder, "hif8"), stream=type("S", (), {"write": messages.append})())
    text = "".join(messages)
    assert status == 2 and text.startswith(f"error: {folder} is unverified (it has no {FOLDER_MANIFEST})")
    assert text.count("error:") == 1 and "trust_unverified=true" in text
    assert tree(tmp_path) == before
    with trusting_unverified(True) as accepted:
        load_for_eval(folder, "hif8")  # the user's explicit choice: loaded, and listed as unverified
    assert list(accepted) == [str(folder)]


def test_a_manifest_that_does_not_list_the_scalers_is_refused(export, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(export, folder)
    doc = json.loads((folder / FOLDER_MANIFEST).read_text())
    del doc["files"]["hif8qat_scalers.safetensors"]
    (folder / FOLDER_MANIFEST).write_text(json.dumps(doc))
    _corrupt_floats(folder / "hif8qat_scalers.safetensors")
    before = tree(tmp_path)
    with pytest.raises(UnverifiedArtefact, match=rf"{FOLDER_MANIFEST} does not list hif8qat_scalers.safetensors"):
        load_for_eval(folder, "hif8")
    assert tree(tmp_path) == before


def test_the_report_reads_no_scaler_traces_from_an_export_without_its_manifest(export, tmp_path):
    from hif8qat.report.replay import recorded_amax_traces

    folder = tmp_path / "export"
    shutil.copytree(export, folder)
    (folder / FOLDER_MANIFEST).unlink()
    with pytest.raises(UnverifiedArtefact, match=f"it has no {FOLDER_MANIFEST}"):
        recorded_amax_traces(folder)


# ------------------------------------------------------------------ a checkpoint's manifest
def test_a_checkpoint_with_a_file_its_manifest_does_not_list_is_refused_and_kept(tmp_path):
    from hif8qat.train import checkpoint as ckpt

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    root = tmp_path / "checkpoints"
    path = ckpt.save_checkpoint(root, 4, model=model, optimizer=opt, scheduler=sched,
                                rank_state={"rng": ckpt.rng_state()})
    ckpt.verify_checkpoint(path)  # the control: as written, it verifies
    (path / "extra.pt").write_bytes(b"not written with the checkpoint")
    before = tree(tmp_path)
    with pytest.raises(UnverifiedArtefact, match="COMPLETE manifest does not list extra.pt"):
        ckpt.select_checkpoint(root, log=lambda _: None)
    assert tree(tmp_path) == before  # not renamed aside as corrupt: the user decides
    with trusting_unverified(True):
        assert ckpt.select_checkpoint(root, log=lambda _: None) == path


# ------------------------------------------------------------------ the rule itself
@pytest.mark.parametrize("recorded,present,why", [
    (None, ["a"], "it has no the record"),
    (["a"], ["a", "b"], "does not list b, which is there"),
    (["a"], ["a", "b", "c"], "does not list b and 1 more"),
])
def test_the_rule_refuses_a_missing_or_partial_record(recorded, present, why):
    with pytest.raises(UnverifiedArtefact, match=why):
        artefacts.require_record("subject", recorded, present, "Redo it", record="the record")
    with trusting_unverified(True) as accepted:
        artefacts.require_record("subject", recorded, present, "Redo it", record="the record")
    assert list(accepted) == ["subject"]
    with pytest.raises(UnverifiedArtefact):  # the trust ended with its block
        artefacts.require_record("subject", recorded, present, "Redo it", record="the record")
    with trusting_unverified(False) as accepted:  # trust is per block: refused again
        with pytest.raises(UnverifiedArtefact):
            artefacts.require_record("subject", recorded, present, "Redo it", record="the record")
    assert accepted == {}


def test_a_whole_record_passes_without_trust():
    with trusting_unverified(False) as accepted:
        artefacts.require_record("subject", ["a", "b"], ["b", "a"], "Redo it", record="the record")
        artefacts.require_record("subject", ["a", "b"], ["a"], "Redo it", record="the record")
    assert accepted == {}


def test_a_redone_mode_drops_the_samples_of_tasks_it_no_longer_evaluates(tmp_path):
    from hif8qat.evaluate.outputs import verify_eval_dir, write_eval_dir

    out = tmp_path / "eval" / "bf16"
    rows = [("0", 1, {"doc_id": 0, "resps": [], "target": 0})]
    write_eval_dir(out, {"mini_arc": {"value": 1.0}, "mini_mmlu": {"value": 1.0}},
                   {"mini_arc": rows, "mini_mmlu": rows}, {"results": {}})
    write_eval_dir(out, {"mini_arc": {"value": 1.0}}, {"mini_arc": rows}, None)  # force=true with fewer tasks
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "samples_mini_arc.csv",
                                                    "samples_mini_arc.jsonl.gz"]
    assert set(verify_eval_dir(out)["_files"]) == {"samples_mini_arc.csv", "samples_mini_arc.jsonl.gz"}


def test_the_lm_eval_dump_is_recorded_beside_the_samples(tmp_path):
    from hif8qat.evaluate.outputs import verify_eval_dir, write_eval_dir

    out = tmp_path / "eval" / "bf16"
    write_eval_dir(out, {"mini_arc": {"value": 1.0}}, {}, {"results": {"mini_arc": {}}})
    recorded = verify_eval_dir(out)["_files"]
    assert recorded == {"lm_eval_results.json": hashlib.sha256((out / "lm_eval_results.json").read_bytes()).hexdigest()}
