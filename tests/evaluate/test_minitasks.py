"""Mini task generator: deterministic, committed data up to date, well-formed, balanced, no duplicates."""

import json
from collections import Counter

import pytest

from hif8qat.evaluate.minitasks import generate as gen


@pytest.fixture(scope="module")
def generated():
    return gen.generate_all()


def test_deterministic_and_committed_data_up_to_date(generated):
    assert gen.generate_all() == generated
    assert gen.check() == [], "run python -m hif8qat.evaluate.minitasks.generate and commit data/"


def test_check_detects_stale_file(tmp_path):
    gen.write_all(tmp_path)
    assert gen.check(tmp_path) == []
    p = gen.data_file("mini_arc", "test", tmp_path)
    p.write_text(p.read_text().replace("Mercury", "Pluto", 1))
    assert gen.check(tmp_path) == ["mini_arc_test.jsonl"]


FIELDS = {"mini_mmlu": ("question", "choices", "answer"), "mini_hellaswag": ("ctx", "endings", "label"),
          "mini_arc": ("question", "choices", "answer")}


@pytest.mark.parametrize("task", gen.TASKS)
def test_items_well_formed(generated, task):
    shot_split, eval_split = gen.SPLITS[task]
    items = generated[task][eval_split]
    shots = generated[task][shot_split]
    q, ch, ans = FIELDS[task]
    assert 250 <= len(items) <= 500
    assert len(shots) >= (5 if task == "mini_mmlu" else 2)
    for it in items + shots:
        opts = it[ch]
        assert len(opts) in ((4,) if task != "mini_arc" else (3, 4))
        assert len(set(opts)) == len(opts), it  # distinct options
        assert 0 <= it[ans] < len(opts)
        assert it[q].strip() and all(o.strip() for o in opts)
    # no duplicate items, and no few-shot example among the evaluated items
    keys = [(it[q], tuple(it[ch])) for it in items]
    assert len(set(keys)) == len(keys)
    assert len({it["id"] for it in items}) == len(items)
    assert not {it["id"] for it in shots} & {it["id"] for it in items}
    def qa(it):
        return it[q], it[ch][it[ans]]

    assert not {qa(it) for it in shots} & {qa(it) for it in items}


def test_correct_answers_match_fact_tables(generated):
    caps = {r["country"]: r["capital"] for r in gen._read("capitals.csv")}
    syms = {r["element"]: r["symbol"] for r in gen._read("elements.csv")}
    n = 0
    for it in generated["mini_mmlu"]["test"]:
        right = it["choices"][it["answer"]]
        if it["source"] == "capital":
            country = it["question"].removeprefix("What is the capital of ").removesuffix("?")
            assert right == caps[country]
            n += 1
        elif it["source"] == "symbol":
            el = it["question"].removeprefix("What is the chemical symbol for ").removesuffix("?")
            assert right == syms[el]
            n += 1
        elif it["source"] == "addition":
            a, b = it["question"].removeprefix("What is ").removesuffix("?").split(" + ")
            assert int(right) == int(a) + int(b)
            n += 1
    assert n > 100
    for it in generated["mini_hellaswag"]["validation"]:
        if it["source"] == "capital":
            city = it["ctx"].removesuffix(" is the capital city of")
            assert caps[it["endings"][it["label"]].rstrip(".")] == city


@pytest.mark.parametrize("task", gen.TASKS)
def test_answer_positions_balanced(generated, task):
    _, eval_split = gen.SPLITS[task]
    items = generated[task][eval_split]
    ans = "label" if task == "mini_hellaswag" else "answer"
    four = [it for it in items if len(it["endings" if task == "mini_hellaswag" else "choices"]) == 4]
    counts = Counter(it[ans] for it in four)
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) - min(counts.values()) <= max(6, len(four) // 25), counts


def test_yaml_tasks_register_and_load():
    from lm_eval.tasks import TaskManager

    from hif8qat.config.eval_tasks import MINITASK_DIR

    tm = TaskManager(include_path=str(MINITASK_DIR), include_defaults=False)
    assert {"mini_mmlu", "mini_hellaswag", "mini_arc", "mini_mmlu_letters"} <= set(tm.all_tasks)
    task = tm.load(["mini_arc"])["tasks"]["mini_arc"]
    docs = list(task.test_docs())
    on_disk = [json.loads(line) for line in gen.data_file("mini_arc", "test").open()]
    assert len(docs) == len(on_disk) and docs[0]["question"] == on_disk[0]["question"]
