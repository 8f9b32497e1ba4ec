"""Preflight opens what a run will read, not only checks that it exists: a corpus with a bad line or no text, a
model folder without a tokenizer or with truncated weights, a refused auto_map, a wandb mode wandb does not know,
more few-shot examples than a task holds, a dangling symbolic link where a folder goes. Each is one ``error:`` line,
exit status 2, and no run folder (no config, run_info or lock) left behind."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_reliability import assert_user_error, cli, cli_config


def inputs():
    """The module under test, imported where used: the command-line cases run against any version of it."""
    from hif8qat.launch import inputs as module

    return module


MINI_DATA = Path(__file__).resolve().parents[2] / "src" / "hif8qat" / "evaluate" / "minitasks" / "data"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A complete save_pretrained folder (config, tokenizer, safetensors weights) of a one-block tiny Llama."""
    from hif8qat.models.loading import build_tiny_llama

    folder = tmp_path_factory.mktemp("model") / "tiny"
    model, tok = build_tiny_llama(num_layers=1)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _copy(model_folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_folder, tmp_path / "model"))


# Each case: (a function building its inputs in tmp_path and returning (overrides, environment), the words its
# error line must hold). Every override line is otherwise a run that trains (stage=train) or trains and evaluates.
def _jsonl_bad_line(tmp_path, _model):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a first document"}\nnot json at all\n{"text": "a third"}\n')
    return [f"data.source={corpus}"], {}


def _jsonl_text_not_a_string(tmp_path, _model):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a document"}\n{"text": 5}\n')
    return [f"data.source={corpus}"], {}


def _jsonl_without_text(tmp_path, _model):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"body": "a document"}\n{"body": "another"}\n')
    return [f"data.source={corpus}"], {}


def _empty_txt(tmp_path, _model):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("")
    return [f"data.source={corpus}"], {}


def _not_parquet(tmp_path, _model):
    corpus = tmp_path / "corpus.parquet"
    corpus.write_bytes(b"this is not a parquet file")
    return [f"data.source={corpus}"], {}


def _no_tokenizer(tmp_path, model):
    folder = _copy(model, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    return [f"model.name={folder}"], {}


def _truncated_weights(tmp_path, model):
    folder = _copy(model, tmp_path)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    return [f"model.name={folder}"], {}


def _missing_shard(tmp_path, model):
    folder = _copy(model, tmp_path)
    first = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors").rename(folder / first)  # sharded: the index names the files to load
    index = {"metadata": {},
             "weight_map": {"model.norm.weight": first, "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return [f"model.name={folder}"], {}


def _refused_remote_code(tmp_path, model):
    folder = _copy(model, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    return [f"model.name={folder}"], {}


def _wandb_mode(tmp_path, _model):
    return ["logger.wandb=true", "logger.wandb_mode=bogus"], {}


def _fewshot_beyond_pool(tmp_path, _model):
    return ["stage=all", "eval.num_fewshot={mini_arc: 1000}"], {}


def _dangling(tmp_path) -> Path:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    return link


def _results_root_dangling(tmp_path, _model):
    return [f"results_root={_dangling(tmp_path)}"], {}


def _results_root_loop(tmp_path, _model):
    link = tmp_path / "loop"
    link.symlink_to(link)
    return [f"results_root={link / 'runs'}"], {}


def _cache_env_dangling(tmp_path, _model):
    return [], {"HIF8QAT_CACHE": str(_dangling(tmp_path))}


def _data_cache_dir_dangling(tmp_path, _model):
    return [f"data.cache_dir={_dangling(tmp_path)}"], {}


def _mini_arc_pool() -> int:
    """Independent of the code under test: the documents of mini_arc's few-shot (train) file."""
    return sum(1 for line in (MINI_DATA / "mini_arc_train.jsonl").read_text().splitlines() if line.strip())


CASES = {
    "jsonl with a bad line": (_jsonl_bad_line, ["data.source=", "corpus.jsonl line 2", "not JSON"]),
    "jsonl text not a string": (_jsonl_text_not_a_string, ["data.source=", "line 2", "not a string"]),
    "jsonl without text": (_jsonl_without_text, ["data.source=", "no text"]),
    "empty txt": (_empty_txt, ["data.source=", "corpus.txt", "no text"]),
    "not parquet": (_not_parquet, ["data.source=", "not a readable parquet file"]),
    "no tokenizer": (_no_tokenizer, ["model.name=", "no tokenizer files", "tokenizer.json"]),
    "truncated weights": (_truncated_weights, ["model.name=", "model.safetensors", "truncated"]),
    "missing shard": (_missing_shard, ["model.name=", "model-00002-of-00002.safetensors", "missing"]),
    "refused remote code": (_refused_remote_code, ["auto_map", "model.trust_remote_code=true"]),
    "wandb mode": (_wandb_mode, ["logger.wandb_mode='bogus'", "offline", "disabled"]),
    "few-shot beyond pool": (_fewshot_beyond_pool, ["eval.num_fewshot.mini_arc=1000", "mini_arc",
                                                    f"at most {_mini_arc_pool()}"]),
    "results_root dangling": (_results_root_dangling, ["results_root=", "symbolic link", "gone"]),
    "results_root loop": (_results_root_loop, ["results_root=", "symbolic link"]),
    "HIF8QAT_CACHE dangling": (_cache_env_dangling, ["HIF8QAT_CACHE=", "symbolic link", "gone"]),
    "data.cache_dir dangling": (_data_cache_dir_dangling, ["data.cache_dir=", "symbolic link", "gone"]),
}


def _run_folders(top: Path) -> list[str]:
    """Everything a run leaves (its folder, config, run_info, lock), found without following links."""
    found = []
    for where, dirs, files in os.walk(top):
        found += [os.path.join(where, n) for n in dirs + files
                  if n.startswith("seed") or n in ("run.lock", "run_info.json", "config_resolved.yaml")]
    return found


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_what_a_run_reads_is_opened_before_its_folder_exists(tmp_path, model_folder, case):
    build, needles = CASES[case]
    overrides, env = build(tmp_path, model_folder)
    root = next((Path(o.split("=", 1)[1]) for o in overrides if o.startswith("results_root=")), tmp_path / "runs")
    out = cli(["experiment=exp1", "stage=train", *overrides], root, env_extra=env)
    assert_user_error(out, *needles)
    assert len([line for line in out.stderr.splitlines() if line.startswith("error: ")]) == 1, out.stderr
    assert _run_folders(tmp_path) == []
    assert not (tmp_path / "gone").exists()  # a dangling link is reported, never followed into a new folder


def test_usable_inputs_pass_every_check(tmp_path, model_folder):
    """The control: the same kinds of input, usable, pass (so each refusal above is about what it names)."""
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text('{"text": "a document"}\n\n{"text": "another", "id": 2}\n')
    txt = tmp_path / "text"
    txt.mkdir()
    (txt / "empty.txt").write_text("")  # one empty file among others is no problem
    (txt / "book.txt").write_text("Some text to train on.\n")
    for source in (jsonl, txt):
        cfg = cli_config(["experiment=exp1", "profile=smoke", f"model.name={model_folder}", f"data.source={source}",
                          "logger.wandb=true", "logger.wandb_mode=offline",
                          f"eval.num_fewshot={{mini_arc: {_mini_arc_pool()}}}", f"data.cache_dir={tmp_path / 'c'}"])
        inputs().check_inputs(cfg)


def test_remote_code_passes_when_allowed(tmp_path, model_folder):
    _refused_remote_code(tmp_path, model_folder)
    cfg = cli_config(["experiment=exp1", "profile=smoke", f"model.name={tmp_path / 'model'}",
                      "model.trust_remote_code=true"])
    inputs().check_remote_code(cfg)


@pytest.mark.parametrize("damage", ["none", "cut", "padded", "header cut", "header not json", "empty"])
def test_the_safetensors_check_agrees_with_the_library(tmp_path, damage):
    """Oracle: safetensors itself, opening the file and reading every tensor."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}, path)
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    damaged = {"none": data, "cut": data[:-3], "padded": data + b"\0" * 8, "header cut": data[:8 + length // 2],
               "header not json": data[:8] + b"x" * length + data[8 + length:], "empty": b""}[damage]
    path.write_bytes(damaged)
    try:
        with safe_open(path, "pt") as f:
            for key in f.keys():
                f.get_tensor(key)
        library_ok = True
    except Exception:  # noqa: BLE001 - any refusal of the library's
        library_ok = False
    problem = inputs().safetensors_problem(path)
    assert (problem is None) == library_ok, (damage, problem)
    if damage != "none":
        assert str(path) in problem
