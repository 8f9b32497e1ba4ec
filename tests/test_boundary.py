"""The exception boundary of every entry point: each class of failure the world raises on bad input (a
library refusing a file or setting, the file system refusing a path, a full disk, Ctrl-C) is one line naming
the library's message and the file or setting concerned, with exit status 2 (130 for Ctrl-C); a bug stays a
traceback. Each case provokes the real exception through the code path a run takes."""

from __future__ import annotations

import errno
import logging
import types
from pathlib import Path

import pytest
import torch

from hif8qat import boundary
from hif8qat.boundary import guarded
from hif8qat.cli import stages
from hif8qat.errors import INTERRUPTED_STATUS, concerning


def _model_folder(root: Path, *, tokenizer: bool = True) -> Path:
    from hif8qat.models.loading import build_tiny_llama, build_tiny_tokenizer

    folder = root / ("model" if tokenizer else "model_without_tokenizer")
    build_tiny_llama(num_layers=1)[0].save_pretrained(folder, safe_serialization=True)
    if tokenizer:
        build_tiny_tokenizer().save_pretrained(folder)
    return folder


def _model_cfg(name: Path):
    return types.SimpleNamespace(model=types.SimpleNamespace(name=str(name), trust_remote_code=None, revision=None),
                                 quirks=types.SimpleNamespace(bf16_params=False),
                                 quant=types.SimpleNamespace(enabled=False),
                                 train=types.SimpleNamespace(activation_checkpointing=False))


def _build_model(folder: Path):
    from hif8qat.compute_dtype import Numerics
    from hif8qat.train.loop import _build_model

    return _build_model(_model_cfg(folder), types.SimpleNamespace(device=torch.device("cpu")), Numerics("none"))


def _first_batch(source: Path):
    from hif8qat.data.loader import build_train_stream
    from hif8qat.models.loading import build_tiny_tokenizer

    with concerning(f"data.source={source}"):  # as the trainer builds it
        stream = build_train_stream(str(source), build_tiny_tokenizer(), seq_len=8, micro_batch_size=1)
    return next(stream)


def case_jsonl_corpus_with_bad_lines(tmp: Path, monkeypatch):
    bad = tmp / "corpus.jsonl"
    bad.write_text('{"text": "a good line of text"}\n{"text": broken\n{"text": "more text"}\n')
    # datasets logs its own complaint first, through a handler bound to an earlier test's captured stderr
    logger = logging.getLogger("datasets")
    monkeypatch.setattr(logger, "level", logging.CRITICAL + 1)
    logger.manager._clear_cache()  # the child loggers cache their effective level
    return (lambda: _first_batch(bad)), [f"data.source={bad}", "JSON parse error"]


def case_empty_txt_corpus(tmp: Path, monkeypatch):
    empty = tmp / "empty.txt"
    empty.write_text("")
    return (lambda: _first_batch(empty)), [str(empty), "fewer than one batch"]


def case_truncated_weights(tmp: Path, monkeypatch):
    folder = _model_folder(tmp)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    return (lambda: _build_model(folder)), [f"model.name={folder}", "SafetensorError"]


def case_model_folder_without_tokenizer(tmp: Path, monkeypatch):
    folder = _model_folder(tmp, tokenizer=False)
    return (lambda: _build_model(folder)), [f"model.name={folder}", "transformers"]


def case_unknown_wandb_mode(tmp: Path, monkeypatch):
    from hif8qat.train.log import MetricsSink

    logger = types.SimpleNamespace(wandb=True, wandb_project="p", wandb_mode="bogus")
    cfg = types.SimpleNamespace(logger=logger, results_root=str(tmp), to_dict=dict)
    (tmp / "run").mkdir()
    return (lambda: MetricsSink(cfg, tmp / "run", True)), ["logger.wandb_mode=bogus", "'offline'"]


def case_lm_eval_few_shot_beyond_its_pool(tmp: Path, monkeypatch):
    from lm_eval.api.samplers import FirstNSampler

    def job():  # what lm-eval asserts inside run.py's evaluation, under the same naming of the settings
        with concerning("the evaluation settings (eval.num_fewshot={mini_arc: 100000})", libraries=("lm_eval",)):
            FirstNSampler([{"q": 1}, {"q": 2}]).sample(100000)

    return job, ["eval.num_fewshot={mini_arc: 100000}", "exceeds the 2 that are available"]


def case_disk_full_at_a_checkpoint(tmp: Path, monkeypatch):
    from hif8qat.train import checkpoint as ckpt

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    def full_disk_save(obj, f, *a, **kw):  # torch.save's only words when the disk fills exactly at a write
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full_disk_save)
    monkeypatch.setattr(ckpt, "free_space", lambda path: 0)  # and no room left for the rest
    return (lambda: ckpt.save_checkpoint(tmp / "checkpoints", 1, model=model, optimizer=opt, scheduler=sched,
                                         rank_state={})), ["no space left on the disk", "checkpoint step 1"]


def case_mismatched_checkpoint(tmp: Path, monkeypatch):
    from hif8qat.train import checkpoint as ckpt

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path = ckpt.save_checkpoint(tmp, 1, model=model, optimizer=opt, scheduler=sched, rank_state={})
    other = torch.nn.Linear(3, 3)
    opt2 = torch.optim.AdamW(other.parameters())
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
    return (lambda: ckpt.load_checkpoint(path, model=other, optimizer=opt2, scheduler=sched2)), [str(path)]


def case_dangling_symlink_as_results_root(tmp: Path, monkeypatch):
    link = tmp / "results"
    link.symlink_to(tmp / "nowhere")
    return (lambda: (link / "mini" / "exp1").mkdir(parents=True, exist_ok=True)), [str(link), "symlink to nothing"]


def case_symlink_loop_in_the_run_path(tmp: Path, monkeypatch):
    (tmp / "a").symlink_to(tmp / "b")
    (tmp / "b").symlink_to(tmp / "a")
    return (lambda: (tmp / "a" / "run").mkdir(parents=True, exist_ok=True)), ["loop of symlinks"]


def case_folder_name_too_long(tmp: Path, monkeypatch):
    return (lambda: (tmp / ("x" * 300)).mkdir()), ["longer than the file system allows", "run_tag"]


def case_cache_a_dangling_symlink(tmp: Path, monkeypatch):
    link = tmp / "cache"
    link.symlink_to(tmp / "gone")

    monkeypatch.setenv("HIF8QAT_CACHE", str(link))

    def job():
        stages.check_cache_env()
        (link / "models").mkdir(parents=True, exist_ok=True)  # the first write into it

    return job, [str(link)]


CASES = {name[5:]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_class_of_failure_is_one_error_line(tmp_path, capsys, monkeypatch, case):
    job, needles = CASES[case](tmp_path, monkeypatch)
    capsys.readouterr()  # what setting the case up printed
    assert boundary.guarded(job) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    # one line, the last (a library may log its own complaint before it raises)
    assert len(lines) == 1 and err.endswith(lines[0] + "\n") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_ctrl_c_is_one_interrupted_line_not_a_traceback(capsys):
    def job():
        raise KeyboardInterrupt

    assert boundary.guarded(job) == INTERRUPTED_STATUS
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C)" in err and "Traceback" not in err


@pytest.mark.parametrize("bug", [AssertionError("an invariant of ours"), RuntimeError("a shape bug"),
                                 OSError(errno.ENOENT, "No such file", "/nope")])
def test_a_bug_outside_any_named_input_stays_a_traceback(bug):
    def job():
        raise bug

    with pytest.raises(type(bug)):
        guarded(job)


def test_torch_errors_in_a_block_that_names_only_lm_eval_stay_tracebacks():
    def job():
        with concerning("the evaluation settings", libraries=("lm_eval",)):
            torch.zeros(2, 3) @ torch.zeros(2, 3)  # a shape bug in our own model code

    with pytest.raises(RuntimeError):
        guarded(job)


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_ctrl_c_in_the_report_is_one_line(monkeypatch, tmp_path, capsys):
    from hif8qat.report import cli

    monkeypatch.setattr(cli, "build_report", _interrupt)
    assert cli.main(["--runs-root", str(tmp_path), "--tables", str(tmp_path / "t"),
                     "--figures", str(tmp_path / "f")]) == INTERRUPTED_STATUS
    assert "interrupted (Ctrl-C)" in capsys.readouterr().err


def test_a_corrupt_result_in_the_report_is_one_error_line(monkeypatch, tmp_path, capsys):
    from hif8qat.artefacts import CorruptArtefact
    from hif8qat.report import cli

    def corrupt(*args, **kwargs):
        raise CorruptArtefact(tmp_path / "results.json", "value is \"abc\", not a number", "Redo it")

    monkeypatch.setattr(cli, "build_report", corrupt)
    assert cli.main(["--runs-root", str(tmp_path), "--tables", str(tmp_path / "t"),
                     "--figures", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "results.json is unreadable" in err and "Traceback" not in err


def test_ctrl_c_in_an_evaluation_is_one_line(monkeypatch, tmp_path, capsys):
    from hif8qat.evaluate import cli

    monkeypatch.setattr(cli, "eval_numerics", _interrupt)
    assert cli.main(["--export", str(tmp_path), "--tasks", "mini_arc"]) == INTERRUPTED_STATUS
    assert "interrupted (Ctrl-C)" in capsys.readouterr().err
