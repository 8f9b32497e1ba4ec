"""One verified reader: every project artefact read back (results, samples, held-out tokens and summary, run_info,
configs) is parsed whole and checked against the sha256 recorded when it was written; a corrupt one is named
with what to run, and stage=eval redoes it instead of calling it done."""

from __future__ import annotations

import gzip
import hashlib
import json
import time
import types
from pathlib import Path

import pytest
from test_reliability import assert_user_error, cli
from test_report import make_fake_runs

from hif8qat.cli import stages
from hif8qat.compute_dtype import Numerics
from hif8qat.errors import RunError
from hif8qat.evaluate import heldout
from hif8qat.evaluate.outputs import write_eval_dir
from hif8qat.stats.heldout import read_summary


def _reader():
    from hif8qat import artefacts as module  # a missing reader fails each test that needs it, not collection

    return module


def _sha(path: Path) -> str:  # the oracle: hashlib directly, not files.sha256_file
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _eval_dir(tmp_path: Path) -> Path:
    out = tmp_path / "eval" / "bf16"
    rows = [(str(i), i % 2, {"doc_id": i, "resps": [], "target": 0}) for i in range(6)]
    write_eval_dir(out, {"mini_arc": {"value": 0.5, "n": 6}, "_meta": {"mode": "bf16"}}, {"mini_arc": rows}, None)
    return out


# ------------------------------------------------------------------ the reader itself
def test_eval_results_record_the_sha256_of_every_file_beside_them(tmp_path):
    out = _eval_dir(tmp_path)
    recorded = json.loads((out / "results.json").read_text())["_files"]
    assert recorded == {name: _sha(out / name) for name in ("samples_mini_arc.csv", "samples_mini_arc.jsonl.gz")}


def test_an_evaluation_written_again_gives_the_same_bytes(tmp_path):
    # a rerun's files (and the sha256 results.json records) depend on the samples only: no time stamp, no temp name
    first = _eval_dir(tmp_path / "a")
    time.sleep(1.1)  # gzip's header counts whole seconds
    second = _eval_dir(tmp_path / "b")
    for name in ("samples_mini_arc.csv", "samples_mini_arc.jsonl.gz"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    with gzip.open(first / "samples_mini_arc.jsonl.gz", "rt") as fh:
        assert [json.loads(line)["doc_id"] for line in fh] == list(range(6))


@pytest.mark.parametrize("text,why", [("", "empty"), ("doc_id,correct\n1,0\n2", "cut"),
                                      ("doc_id,correct\n1,0\n2\n", "line 3 has 1 fields"),
                                      ("doc_id,correct\n1,0,7\n", "line 2 has 3 fields")])
def test_a_csv_cut_mid_row_is_refused_not_padded(tmp_path, text, why):
    p = tmp_path / "samples_x.csv"
    p.write_text(text)
    with pytest.raises(RunError, match=why) as err:
        _reader().read_csv(p, "run X")
    assert str(p) in str(err.value) and "run X" in str(err.value)


@pytest.mark.parametrize("payload,why", [(b"[1, 2]", "list where a dict"), (b'{"a": ', "JSONDecodeError"),
                                         (b"\xff\xfe{}", "UnicodeDecodeError")])
def test_json_that_is_not_the_mapping_written_is_refused(tmp_path, payload, why):
    p = tmp_path / "run_info.json"
    p.write_bytes(payload)
    with pytest.raises(RunError, match=why):
        _reader().read_json(p, "redo")


def test_a_file_whose_hash_changed_is_refused(tmp_path):
    p = tmp_path / "f.json"
    p.write_text('{"a": 1}')
    digest = _sha(p)
    _reader().read_json(p, "redo", sha256=digest)
    p.write_text('{"a": 2}')  # parses, but is not what was written
    with pytest.raises(RunError, match="sha256"):
        _reader().read_json(p, "redo", sha256=digest)


# ------------------------------------------------------------------ stage=eval redoes what is corrupt
def test_an_intact_mode_is_done(tmp_path):
    assert stages._mode_done(_eval_dir(tmp_path))


@pytest.mark.parametrize("damage", ["truncate_results", "results_is_a_list", "cut_samples_csv", "cut_samples_gz",
                                    "edit_samples_csv"])
def test_a_corrupt_mode_is_evaluated_again_not_called_done(tmp_path, damage, capsys):
    out = _eval_dir(tmp_path)
    results, csv_p, gz = out / "results.json", out / "samples_mini_arc.csv", out / "samples_mini_arc.jsonl.gz"
    if damage == "truncate_results":
        results.write_text(results.read_text()[:30])
    elif damage == "results_is_a_list":
        results.write_text("[]")
    elif damage == "cut_samples_csv":
        csv_p.write_bytes(csv_p.read_bytes()[:-9])
    elif damage == "cut_samples_gz":
        gz.write_bytes(gz.read_bytes()[: len(gz.read_bytes()) // 2])
    else:  # a whole, well-formed row changed: only the recorded hash sees it
        csv_p.write_text(csv_p.read_text().replace("\n0,0,", "\n0,1,", 1))
    assert not stages._mode_done(out)
    assert "evaluating bf16 again" in capsys.readouterr().out


def test_a_mode_written_before_hashes_were_recorded_is_evaluated_again_unless_trusted(tmp_path, capsys):
    out = _eval_dir(tmp_path)
    doc = json.loads((out / "results.json").read_text())
    del doc["_files"]
    (out / "results.json").write_text(json.dumps(doc))
    assert not stages._mode_done(out)  # nothing vouches for its samples: evaluated again
    assert "unverified (it has no _files record): evaluating bf16 again" in capsys.readouterr().out
    with _reader().trusting_unverified(True) as accepted:
        assert stages._mode_done(out)  # trusted: kept, and listed as used unverified
        (out / "samples_mini_arc.csv").write_text("doc_id,correct,gold_ll,gold_margin\n0,1\n")
        assert not stages._mode_done(out)  # still checked for cut rows
    assert list(accepted) == [str(out / "results.json")]


# ------------------------------------------------------------------ the held-out comparison
def _heldout_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    d = run / "eval" / "heldout"
    d.mkdir(parents=True)
    tokens = d / "tokens.csv.gz"
    tokens.write_bytes(gzip.compress(b"window,pos,nll_bf16\n" + b"".join(b"0,%d,1.5\n" % i for i in range(200))))
    doc = {"models": {"baseline": {}, "bf16": {}, "hif8": {}}, "baseline_run": "base", "tokens_file": tokens.name,
           "tokens_sha256": _sha(tokens), "comparisons": {}}
    (d / "summary.json").write_text(json.dumps(doc))
    return run


def _after_eval(run: Path, monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(heldout, "compute_heldout", lambda *a, **k: calls.append(a) or {})
    monkeypatch.setattr(heldout, "format_summary", lambda doc: "")
    cfg = types.SimpleNamespace(quant=types.SimpleNamespace(enabled=True), eval=types.SimpleNamespace(
        modes=["bf16", "hif8"]), force=False, results_root=str(run.parent))
    heldout.after_eval(cfg, run, device="cpu", numerics=Numerics("none"))
    return calls


@pytest.mark.parametrize("damage", ["cut_tokens", "truncate_summary", "summary_is_a_list"])
def test_a_corrupt_heldout_comparison_is_redone(tmp_path, monkeypatch, damage, capsys):
    run = _heldout_run(tmp_path)
    assert _after_eval(run, monkeypatch) == []  # the control: an intact comparison is kept
    d = run / "eval" / "heldout"
    if damage == "cut_tokens":
        data = (d / "tokens.csv.gz").read_bytes()
        (d / "tokens.csv.gz").write_bytes(data[: len(data) // 2])
    elif damage == "truncate_summary":
        (d / "summary.json").write_text((d / "summary.json").read_text()[:40])
    else:
        (d / "summary.json").write_text("[]")
    assert len(_after_eval(run, monkeypatch)) == 1
    assert "redoing the held-out comparison" in capsys.readouterr().out
    with pytest.raises(RunError, match="stage=eval"):  # the report's reader names it and what to run
        read_summary(run)


def test_heldout_cli_refuses_a_missing_run_on_stderr_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "run"
    assert heldout.main(["--run", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and str(missing) in captured.err and "error" not in captured.out
    assert not (tmp_path / "no").exists()


# ------------------------------------------------------------------ the report
def test_report_refuses_an_empty_samples_file_by_name(tmp_path):
    runs_root = make_fake_runs(tmp_path / "runs", exps=("exp7", "exp8"))
    samples = runs_root / "smoke" / "exp8" / "seed0" / "eval" / "hif8" / "samples_mini_arc.csv"
    samples.write_text("")
    out = cli(["experiment=exp8", "stage=report"], runs_root)
    assert_user_error(out, str(samples), "empty", "stage=eval")


def test_report_refuses_a_samples_file_cut_mid_row(tmp_path):
    runs_root = make_fake_runs(tmp_path / "runs", exps=("exp7", "exp8"))
    samples = runs_root / "smoke" / "exp8" / "seed0" / "eval" / "hif8" / "samples_mini_arc.csv"
    samples.write_text(samples.read_text()[:-3])
    out = cli(["experiment=exp8", "stage=report"], runs_root)
    assert_user_error(out, str(samples), "stage=eval")


def test_report_refuses_a_truncated_heldout_summary_instead_of_dropping_its_rows(tmp_path):
    runs_root = make_fake_runs(tmp_path / "runs", exps=("exp7", "exp8"))
    summary = runs_root / "smoke" / "exp8" / "seed0" / "eval" / "heldout" / "summary.json"
    summary.parent.mkdir(parents=True)
    summary.write_text('{"models": {"bf16": ')
    out = cli(["experiment=exp8", "stage=report"], runs_root)
    assert_user_error(out, str(summary), "stage=eval")


@pytest.mark.parametrize("name,payload", [("run_info.json", b"[1, 2]"), ("config_resolved.yaml", b"seed: \xff\xfe\n"),
                                          ("config_resolved.yaml", b"- a list\n")])
def test_report_leaves_out_a_run_whose_record_is_unreadable_and_says_so(tmp_path, name, payload):
    runs_root = make_fake_runs(tmp_path / "runs", exps=("exp7", "exp8"))
    broken = runs_root / "smoke" / "exp8" / "seed0"
    (broken / name).write_bytes(payload)
    out = cli(["experiment=exp8", "stage=report"], runs_root)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    listed = out.stdout[out.stdout.index("runs not used"):]
    assert f"{broken}: {name} does not parse" in listed
