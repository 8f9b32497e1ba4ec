"""What the console shows when things go wrong: an error's line starts a line of its own (the progress bar is
closed first), an evaluation outside a git checkout prints nothing of git's, and the report's figures raise
no matplotlib warning."""

from __future__ import annotations

import errno
import warnings
from pathlib import Path

import pandas as pd
from test_checkpoint import _smoke

from hif8qat import boundary


def _error_lines_stand_alone(err: str) -> list[str]:
    """The lines holding "error:" as the terminal shows them (a bar redraws with a carriage return, so only a
    newline starts a line); each must start with it."""
    shown = [line.rsplit("\r", 1)[-1] for line in err.split("\n")]
    errors = [line for line in err.split("\n") if "error:" in line]
    assert errors, err
    for line in errors:
        assert line.startswith("error: "), f"the error is glued to another line: {line[:300]!r}"
    return [line for line in shown if line.startswith("error: ")]


def _train_with_bar(tmp_path: Path, *overrides: str):
    from hif8qat.config.numerics import train_numerics
    from hif8qat.train.loop import train

    (tmp_path / "run").mkdir()
    cfg = _smoke(tmp_path, "logger.progress_bar=true", *overrides)
    return lambda: train(cfg, tmp_path / "run", numerics=train_numerics(cfg))


def test_a_diverging_run_closes_its_progress_bar_before_the_error(tmp_path, capsys):
    job = _train_with_bar(tmp_path, "train.lr=1e30", "train.max_consecutive_skips=0")
    capsys.readouterr()
    assert boundary.guarded(job) == 2
    assert "non-finite" in _error_lines_stand_alone(capsys.readouterr().err)[0]


def test_a_full_disk_at_the_first_metrics_write_closes_the_bar_before_the_error(tmp_path, capsys, monkeypatch):
    from hif8qat.files import storage_error
    from hif8qat.train import log

    def full(path, text):
        raise storage_error(OSError(errno.ENOSPC, "No space left on device", str(path)))

    monkeypatch.setattr(log, "append_text", full)
    job = _train_with_bar(tmp_path)
    capsys.readouterr()
    assert boundary.guarded(job) == 2
    assert "no space left" in _error_lines_stand_alone(capsys.readouterr().err)[0]


def test_lm_eval_asks_git_quietly_outside_a_checkout(tmp_path, monkeypatch, capfd):
    import lm_eval.evaluator

    from hif8qat.evaluate.runner import _quiet_lm_eval

    monkeypatch.chdir(tmp_path)  # no git checkout here or above
    with _quiet_lm_eval(None):
        commit = lm_eval.evaluator.get_git_commit_hash()  # what simple_evaluate calls
    assert commit is None
    assert "fatal" not in capfd.readouterr().err


def test_scale_figures_of_a_run_without_amax_columns_raise_no_legend_warning(tmp_path):
    import types

    from hif8qat.report.figures import make_figures

    run = types.SimpleNamespace(path=tmp_path, experiment="exp3", seed=0, estimator="max")
    metrics = pd.DataFrame({"step": [0, 1, 2], "loss": [3.0, 2.9, 2.8], "mlp/amax_ratio_max": [0.5, 0.7, 0.9]})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        files = make_figures([], [run], {str(tmp_path): metrics}, pd.DataFrame(), tmp_path / "figures", "mini")
    assert files and not [w for w in seen if "legend" in str(w.message)], [str(w.message) for w in seen]


