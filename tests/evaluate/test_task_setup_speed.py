"""lm-eval builds the evaluation's tasks faster with the same documents and prompts: a local parquet copy read by
datasets' packaged parquet loader (the folder's card read once, never hashed per config), each Jinja template
compiled once, and only the subsets' documents formatted (:mod:`hif8qat.evaluate.task_data`). The oracles: datasets
loading the folder by name, lm-eval's own template rendering and its own document selection outside the speed-ups."""

from __future__ import annotations

import inspect

import datasets
import datasets.load
import lm_eval.utils
import pytest
from lm_eval.tasks import TaskManager

from hif8qat.config import eval_tasks
from hif8qat.config.eval_tasks import MINITASK_DIR
from hif8qat.evaluate import task_data

SPLITS = ("dev", "validation", "test")


def _mmlu_like_copy(root, subjects=("anatomy", "astronomy"), features_for=()):
    """A local copy laid out as the offline benchmarks write cais/mmlu: one parquet file per subject and split, a
    card naming each (``features_for``: subjects whose card also declares features, as hub cards do)."""
    lines = ["---", "configs:"]
    for subject in subjects:
        (root / subject).mkdir(parents=True)
        lines += [f"- config_name: {subject}", "  data_files:"]
        for s in SPLITS:
            rows = [{"question": f"{subject} {s} question {i}?", "subject": subject,
                     "choices": [f"{subject} {i}", "b", "c", "d"], "answer": i % 4} for i in range(6)]
            datasets.Dataset.from_list(rows).to_parquet(str(root / subject / f"{s}-00000-of-00001.parquet"))
            lines += [f"  - split: {s}", f"    path: {subject}/{s}-00000-of-00001.parquet"]
    lines += ["dataset_info:"]
    for subject in subjects:
        lines += [f"- config_name: {subject}", "  description: a test copy"]
        if subject in features_for:
            lines += ["  features:", "  - name: question", "    dtype: string"]
    (root / "README.md").write_text("\n".join(lines + ["---", "# a test copy", ""]))
    return root


@pytest.fixture
def own_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")


def test_a_parquet_copy_is_read_by_the_parquet_loader_with_the_same_documents(tmp_path, own_datasets_cache,
                                                                              monkeypatch):
    spec = eval_tasks.TASKS["mmlu_continuation"]
    copy = _mmlu_like_copy(tmp_path / "mmlu")
    cards = []
    monkeypatch.setattr(task_data, "card_header", lambda folder, real=task_data.card_header: cards.append(folder)
                        or real(folder))
    extra, _ = task_data.prepare_paper_tasks([spec], {"cais/mmlu": copy}, tmp_path / "work",
                                             index=task_data.task_index_for([spec]))
    assert cards == [copy.resolve()]  # one read of the card for all the copy's subjects
    folder_loads = []
    monkeypatch.setattr(datasets.load.LocalDatasetModuleFactory, "get_module",
                        lambda self, real=datasets.load.LocalDatasetModuleFactory.get_module:
                        folder_loads.append(self.path) or real(self))
    tm = TaskManager(include_path=[str(p) for p in task_data.lm_eval_task_dirs([spec]) + extra],
                     include_defaults=False)
    task = tm.load(["mmlu_anatomy_continuation"])["tasks"]["mmlu_anatomy_continuation"]
    assert folder_loads == []
    by_name = datasets.load_dataset(str(copy), "anatomy")  # the oracle: the folder loaded by name, as before
    for split in SPLITS:
        assert list(task.dataset[split]) == list(by_name[split])
        assert task.dataset[split].features == by_name[split].features
    assert list(task.eval_docs) == list(by_name["test"])


def test_a_card_that_declares_features_keeps_the_folder_loaded_by_name(tmp_path):
    spec = eval_tasks.TASKS["mmlu_continuation"]
    copy = _mmlu_like_copy(tmp_path / "mmlu", features_for=("anatomy",))
    extra, _ = task_data.prepare_paper_tasks([spec], {"cais/mmlu": copy}, tmp_path / "work",
                                             index=task_data.task_index_for([spec]))
    anatomy = (extra[0] / "mmlu_anatomy_continuation.yaml").read_text()
    astronomy = (extra[0] / "mmlu_astronomy_continuation.yaml").read_text()
    assert f'dataset_path: "{copy.resolve()}"' in anatomy and "parquet" not in anatomy
    assert "dataset_path: parquet" in astronomy and str(copy.resolve() / "astronomy" / "test-") in astronomy


def test_parquet_files_only_for_explicit_parquet_files(tmp_path):
    copy = _mmlu_like_copy(tmp_path / "mmlu", subjects=("anatomy",))
    card = task_data.card_header(copy)
    files = task_data.local_parquet_files(copy, "anatomy", card)
    assert files == {s: [str((copy / "anatomy" / f"{s}-00000-of-00001.parquet").resolve())] for s in SPLITS}
    assert task_data.local_parquet_files(copy, "missing", card) is None
    globbed = {"configs": [{"config_name": "anatomy", "data_files": [{"split": "test", "path": "anatomy/test-*"}]}]}
    assert task_data.local_parquet_files(copy, "anatomy", globbed) is None
    (copy / ".huggingface.yaml").write_text("configs: []\n")
    assert task_data.local_parquet_files(copy, "anatomy", card) is None


@pytest.fixture(scope="module")
def mini_arc():
    tm = TaskManager(include_path=[str(MINITASK_DIR)], include_defaults=False)
    return tm.load(["mini_arc"])["tasks"]["mini_arc"]


def test_each_template_is_compiled_once_and_renders_as_lm_eval_renders_it(mini_arc, monkeypatch):
    docs = list(mini_arc.eval_docs)[:20]

    def prompts():
        return [(mini_arc.doc_to_text(d), mini_arc.doc_to_target(d), mini_arc.doc_to_choice(d)) for d in docs]

    expected = prompts()  # lm-eval's own rendering: a compilation per call
    compiled = []
    real = lm_eval.utils.env.from_string
    monkeypatch.setattr(lm_eval.utils.env, "from_string", lambda source: compiled.append(source) or real(source))
    own_apply_template = lm_eval.utils.apply_template
    with task_data.compiled_jinja_templates():
        assert prompts() == expected
    assert sorted(compiled) == sorted({mini_arc.config.doc_to_text, mini_arc.config.doc_to_target,
                                       mini_arc.config.doc_to_choice})
    assert lm_eval.utils.apply_template is own_apply_template


def test_compiled_templates_keep_lm_eval_filters_and_strict_names():
    template = "{{ text | regex_replace('a+', 'A') }}\n"
    expected = lm_eval.utils.apply_template(template, {"text": "baaad"})
    with task_data.compiled_jinja_templates():
        assert lm_eval.utils.apply_template(template, {"text": "baaad"}) == expected == "bAd\n"
        with pytest.raises(Exception) as err:
            lm_eval.utils.apply_template("{{ missing }}", {})
    with pytest.raises(type(err.value)):
        lm_eval.utils.apply_template("{{ missing }}", {})


def test_selected_documents_come_as_lm_eval_selects_them_and_only_they_are_formatted(mini_arc, monkeypatch):
    import datasets.arrow_dataset
    from lm_eval.api.task import ConfigurableTask, Task

    # the adapter replaces the method every configurable task uses, with its keywords
    assert "doc_iterator" not in ConfigurableTask.__dict__
    assert list(inspect.signature(Task.doc_iterator).parameters) == ["self", "rank", "limit", "world_size", "samples"]
    own_doc_iterator = Task.doc_iterator
    n = len(mini_arc.eval_docs)
    formatted = []
    real = datasets.arrow_dataset.format_table
    monkeypatch.setattr(datasets.arrow_dataset, "format_table",
                        lambda *args, **kwargs: formatted.append(1) or real(*args, **kwargs))
    for samples in ([0, 3, 4, 17, n - 1], [5], None):
        for rank, world_size in ((0, 1), (1, 2)):
            kwargs = {"rank": rank, "world_size": world_size, "samples": samples}
            formatted.clear()
            expected = list(mini_arc.doc_iterator(**kwargs))  # lm-eval's own selection
            assert len(formatted) >= n  # every document: what the adapter is for (its reason to go when this fails)
            formatted.clear()
            with task_data.selected_docs_only():
                got = list(mini_arc.doc_iterator(**kwargs))
            assert got == expected
            assert len(formatted) == (len(samples) if samples else n)
    with task_data.selected_docs_only(), pytest.raises(AssertionError):  # lm-eval's check of the indices
        list(mini_arc.doc_iterator(samples=[0, n]))
    assert Task.doc_iterator is own_doc_iterator


def test_an_evaluation_compiles_each_template_once_and_formats_only_its_subsets_documents(tmp_path, monkeypatch):
    import datasets.arrow_dataset

    from hif8qat.evaluate import runner
    from hif8qat.models.loading import build_tiny_llama

    compiled, formatted = [], []
    real_compile, real_format = lm_eval.utils.env.from_string, datasets.arrow_dataset.format_table
    monkeypatch.setattr(lm_eval.utils.env, "from_string", lambda source: compiled.append(source)
                        or real_compile(source))
    monkeypatch.setattr(datasets.arrow_dataset, "format_table",
                        lambda *args, **kwargs: formatted.append(1) or real_format(*args, **kwargs))
    model, tok = build_tiny_llama(num_layers=1, hidden_size=32, intermediate_size=64)
    res = runner.evaluate_model(model, tok, "mini_arc", subset={"mini_arc": 5}, batch_size=4,
                                num_fewshot={"mini_arc": 0})
    assert res["mini_arc"]["n"] == 5 and res["_meta"]["subset"]["mini_arc"]["of"] >= 250
    assert compiled and len(compiled) == len(set(compiled))
    assert len(formatted) < 50  # the 5 documents (and a few of the few-shot split's), not the test split's 250+
