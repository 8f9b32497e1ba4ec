"""Paths that ended in a traceback or a misleading message end in one `error:` line naming the setting or file:
a symlinked export staging folder, a checkpoint of another micro batch size, a fractional --limit, evaluating a
diverged run; and a finished rerun removes the FAILED marker of its diverged attempt."""

from __future__ import annotations

import json

import pytest
from test_reliability import cli_config

from hif8qat.cli import stages
from hif8qat.errors import RunError
from hif8qat.evaluate.cli import main as evaluate_main
from hif8qat.runs import folders
from hif8qat.train.checkpoint import PROVENANCE_FILE, CheckpointError
from hif8qat.train.provenance import check_provenance, run_provenance


def test_a_symlinked_export_staging_folder_is_refused_before_training_and_left_alone(tmp_path):
    cfg = cli_config(["experiment=exp1", "profile=smoke", "stage=train", f"results_root={tmp_path / 'runs'}"])
    run_dir = folders.run_dir_for(cfg)
    run_dir.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (run_dir / "export.tmp").symlink_to(elsewhere)
    try:
        with pytest.raises(folders.RunFolderError, match=r"export\.tmp is a symbolic link"):
            folders.prepare_run_dir(cfg)
    finally:
        folders.release_run_dir(run_dir)
    assert (run_dir / "export.tmp").is_symlink() and (elsewhere / "keep.txt").read_text() == "mine"
    assert not (run_dir / folders.CONFIG_FILE).exists()  # refused before the run recorded anything


def test_a_checkpoint_of_another_micro_batch_size_is_refused_naming_it(tmp_path):
    argv = ["experiment=exp1", "profile=smoke", f"results_root={tmp_path}"]
    written, resumed = cli_config(argv + ["train.micro_batch_size=2"]), cli_config(argv + ["train.micro_batch_size=4"])
    assert written.train.global_batch_size == resumed.train.global_batch_size
    ckpt = tmp_path / "step_0000004"
    ckpt.mkdir()
    (ckpt / PROVENANCE_FILE).write_text(json.dumps(run_provenance(written)))
    with pytest.raises(CheckpointError, match="train.micro_batch_size: checkpoint 2, this run 4"):
        check_provenance(ckpt, run_provenance(resumed), allow_mismatch=False, explicit=True)
    check_provenance(ckpt, run_provenance(written), allow_mismatch=False, explicit=True)  # its own: accepted


@pytest.mark.parametrize("limit", ["0.5", "2.5", "0", "-3"])
def test_limit_is_a_whole_number_of_documents(limit, tmp_path, capsys):
    assert evaluate_main(["--model", "tiny", "--tasks", "mini_arc", "--limit", limit]) == 2
    err = capsys.readouterr().err
    assert f"error: --limit {limit}: allowed a whole number of documents >= 1" in err and "Traceback" not in err


def test_eval_of_a_diverged_run_says_it_diverged(tmp_path):
    run_dir = tmp_path / "seed0"
    run_dir.mkdir()
    (run_dir / "FAILED").write_text("loss became non-finite at step 5\n")  # as training writes it
    with pytest.raises(RunError, match="diverged in training.*loss became non-finite at step 5"):
        stages._modes_to_evaluate(None, run_dir)


def test_a_finished_rerun_removes_the_failed_marker(tmp_path):
    (tmp_path / "FAILED").write_text("gradient norm non-finite\n")  # the diverged attempt's
    folders.mark_done(tmp_path)
    assert (tmp_path / "DONE").exists() and not (tmp_path / "FAILED").exists()
