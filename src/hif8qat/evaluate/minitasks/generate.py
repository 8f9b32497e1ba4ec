"""Generate the offline mini evaluation tasks from the fact tables in ``facts/``.

Three tasks, each in the format of one of the paper's benchmarks, so that the mini profile measures the same
kind of accuracy drop without any download: ``mini_mmlu`` (four lettered options, ``acc`` on the letter),
``mini_hellaswag`` (four endings, ``acc_norm``) and ``mini_arc`` ("Question: ... Answer:" with 3-4 answer
texts, ``acc_norm``). Every item comes from a shipped fact table, its distractors from the same table. The
output is deterministic (fixed seed, tables in file order), the correct answer's position is balanced over the
options, and no item appears twice."""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FACTS = HERE / "facts"
DATA = HERE / "data"
SEED = 20260526

TASKS = ("mini_mmlu", "mini_hellaswag", "mini_arc")
# split holding the few-shot examples and the evaluated split, per task
SPLITS = {"mini_mmlu": ("dev", "test"), "mini_hellaswag": ("train", "validation"), "mini_arc": ("train", "test")}


def _read(name: str) -> list[dict[str, str]]:
    path = FACTS / name
    with path.open(newline="", encoding="utf-8") as fh:
        delim = "\t" if name.endswith(".tsv") else ","
        rows = [dict(r) for r in csv.DictReader(fh, delimiter=delim)]
    seen, out = set(), []
    for r in rows:  # tables are de-duplicated on read so a repeated line cannot create a duplicate item
        key = tuple(r.values())
        if key not in seen:
            seen.add(key)
            out.append({k: v.strip() for k, v in r.items()})
    return out


def _distractors(rng: random.Random, correct: str, pool: list[str], k: int, exclude=()) -> list[str]:
    cands = sorted({p for p in pool if p != correct and p not in exclude})
    if len(cands) < k:
        raise ValueError(f"not enough distractors for {correct!r}: {cands}")
    return rng.sample(cands, k)


def _place(rng: random.Random, correct: str, distractors: list[str], pos: int) -> tuple[list[str], int]:
    others = list(distractors)
    rng.shuffle(others)
    options = others[:pos] + [correct] + others[pos:]
    return options, pos


def _balance(rng: random.Random, raw: list[dict], key_choices: str, key_answer: str) -> list[dict]:
    """Shuffle item order, then put the correct option at position i % n_choices (balanced letters)."""
    items = list(raw)
    rng.shuffle(items)
    out = []
    for i, it in enumerate(items):
        n = len(it["_distractors"]) + 1
        options, ans = _place(rng, it["_correct"], it["_distractors"], i % n)
        doc = {k: v for k, v in it.items() if not k.startswith("_")}
        doc[key_choices] = options
        doc[key_answer] = ans
        out.append(doc)
    return out


def _split_shots(items: list[dict], shot_ids: list[str]) -> tuple[list[dict], list[dict]]:
    by_id = {it["id"]: it for it in items}
    shots = [by_id[i] for i in shot_ids]
    rest = [it for it in items if it["id"] not in set(shot_ids)]
    return shots, rest


def _number_words():
    return ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
            "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
            "twenty"]


# --------------------------------------------------------------------------------------------- mini_mmlu
def build_mini_mmlu(seed: int = SEED) -> dict[str, list[dict]]:
    """mini_mmlu's items: question + four lettered options (MMLU format).

    Args:
        seed: the generator's seed.

    Returns:
        ``{dev, test}`` -> items."""
    rng = random.Random(seed)
    raw: list[dict] = []

    def add(src, idx, question, correct, distractors):
        raw.append({"id": f"{src}-{idx}", "source": src, "question": question,
                    "_correct": correct, "_distractors": distractors})

    caps = _read("capitals.csv")
    cap_pool = [r["capital"] for r in caps]
    for i, r in enumerate(caps):
        add("capital", i, f"What is the capital of {r['country']}?", r["capital"],
            _distractors(rng, r["capital"], cap_pool, 3))
    els = _read("elements.csv")
    sym_pool = [r["symbol"] for r in els]
    for i, r in enumerate(els):
        add("symbol", i, f"What is the chemical symbol for {r['element']}?", r["symbol"],
            _distractors(rng, r["symbol"], sym_pool, 3))
    animals = _read("animals.csv")
    cls_pool = sorted({r["class"] for r in animals})
    for i, r in enumerate(animals):
        add("animal_class", i, f"What kind of animal is a {r['animal']}?", r["class"],
            _distractors(rng, r["class"], cls_pool, 3))
    ants = _read("antonyms.csv")
    ant_pool = [r["antonym"] for r in ants]
    words = {r["word"] for r in ants}
    for i, r in enumerate(ants):
        # a distractor must not itself be the word (e.g. "light" for "light") or its antonym
        add("antonym", i, f"What is the opposite of \"{r['word']}\"?", r["antonym"],
            _distractors(rng, r["antonym"], ant_pool, 3, exclude={r["word"]} | (words & {r["antonym"]})))
    for i in range(40):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        s = a + b
        near = [str(x) for x in {s - 2, s - 1, s + 1, s + 2, s + 10} if x > 0]
        add("addition", i, f"What is {a} + {b}?", str(s), _distractors(rng, str(s), near, 3))
    raw = _dedupe(raw, key=lambda it: it["question"])
    items = _balance(rng, raw, "choices", "answer")
    # five shots, one per source, with answer letters A B C D A (first_n sampler keeps this order)
    shot_ids = []
    for src, letter in zip(("capital", "animal_class", "symbol", "antonym", "addition"), (0, 1, 2, 3, 0)):
        it = next(x for x in items if x["source"] == src and x["answer"] == letter and x["id"] not in shot_ids)
        shot_ids.append(it["id"])
    dev, test = _split_shots(items, shot_ids)
    return {"dev": dev, "test": test}


# ---------------------------------------------------------------------------------------- mini_hellaswag
def build_mini_hellaswag(seed: int = SEED) -> dict[str, list[dict]]:
    """mini_hellaswag's items: context + four endings (HellaSwag format).

    Args:
        seed: the generator's seed (this task uses seed + 1).

    Returns:
        ``{train, validation}`` -> items."""
    rng = random.Random(seed + 1)
    raw: list[dict] = []

    def add(src, idx, ctx, correct, distractors):
        raw.append({"id": f"{src}-{idx}", "source": src, "ctx": ctx,
                    "_correct": correct, "_distractors": distractors})

    cs = _read("commonsense.tsv")
    cs_pool = [r["ending"] for r in cs]
    for i, r in enumerate(cs):
        add("commonsense", i, r["context"], r["ending"], _distractors(rng, r["ending"], cs_pool, 3))
    cols = _read("colors.csv")
    col_pool = sorted({r["color"] for r in cols})
    for i, r in enumerate(cols):
        add("color", i, f"The color of {r['thing']} is", r["color"] + ".",
            [c + "." for c in _distractors(rng, r["color"], col_pool, 3)])
    seqs = {
        "days": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
        "months": ["January", "February", "March", "April", "May", "June", "July", "August", "September",
                   "October", "November", "December"],
        "numbers": _number_words(),
    }
    for name, seq in seqs.items():
        cyclic = name != "numbers"
        n = len(seq) if cyclic else len(seq) - 3
        for i in range(n):
            window = [seq[(i + j) % len(seq)] for j in range(3)]
            nxt = seq[(i + 3) % len(seq)]
            add(f"seq_{name}", i, ", ".join(window) + ",", nxt + ".",
                [d + "." for d in _distractors(rng, nxt, seq, 3, exclude=set(window))])
    caps = _read("capitals.csv")
    country_pool = [r["country"] for r in caps]
    for i, r in enumerate(caps):
        add("capital", i, f"{r['capital']} is the capital city of", r["country"] + ".",
            [c + "." for c in _distractors(rng, r["country"], country_pool, 3)])
    raw = _dedupe(raw, key=lambda it: it["ctx"])
    items = _balance(rng, raw, "endings", "label")
    shot_ids = []
    for src, lab in zip(("commonsense", "capital", "commonsense"), (1, 3, 0)):
        it = next(x for x in items if x["source"] == src and x["label"] == lab and x["id"] not in shot_ids)
        shot_ids.append(it["id"])
    train, val = _split_shots(items, shot_ids)
    return {"train": train, "validation": val}


# ---------------------------------------------------------------------------------------------- mini_arc
def build_mini_arc(seed: int = SEED) -> dict[str, list[dict]]:
    """mini_arc's items: a question with 3-4 answer texts (ARC format).

    Args:
        seed: the generator's seed (this task uses seed + 2).

    Returns:
        ``{train, test}`` -> items."""
    rng = random.Random(seed + 2)
    raw: list[dict] = []

    def add(src, idx, question, correct, distractors):
        raw.append({"id": f"{src}-{idx}", "source": src, "question": question,
                    "_correct": correct, "_distractors": distractors})

    for i, r in enumerate(_read("science.tsv")):
        add("science", i, r["question"], r["answer"], [r["d1"], r["d2"], r["d3"]])
    animals = _read("animals.csv")
    by_class: dict[str, list[str]] = {}
    for r in animals:
        by_class.setdefault(r["class"], []).append(r["animal"])
    article = {c: ("an" if c[0] in "aeiou" else "a") for c in by_class}
    k = 0
    for cls, members in by_class.items():
        if cls == "arachnid":
            continue
        others = [a for r in animals if r["class"] != cls for a in [r["animal"]]]
        for animal in rng.sample(members, min(len(members), 12)):
            add("which_class", k, f"Which of these animals is {article[cls]} {cls}?", f"a {animal}",
                [f"a {d}" for d in _distractors(rng, animal, others, 3)])
            k += 1
    els = _read("elements.csv")
    el_pool = [r["element"] for r in els]
    for i, r in enumerate(els):
        add("element", i, f"Which element has the chemical symbol {r['symbol']}?", r["element"],
            _distractors(rng, r["element"], el_pool, 3))
    for i, r in enumerate(els):
        add("state", i, f"At room temperature, what is the state of matter of {r['element']}?",
            f"a {r['state']}", [f"a {s}" for s in ("solid", "liquid", "gas") if s != r["state"]])
    for i, r in enumerate(rng.sample(animals, 40)):
        legs = r["legs"]
        add("legs", i, f"How many legs does a {r['animal']} have?", legs,
            _distractors(rng, legs, ["0", "2", "4", "6", "8"], 3))
    planets = ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]
    ordinals = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]
    for i, (p, o) in enumerate(zip(planets, ordinals)):
        add("planet", i, f"Which planet is the {o} planet from the Sun?", p, _distractors(rng, p, planets, 3))
    names = ["Tom", "Anna", "Ben", "Maria", "Sam", "Lucy", "Jack", "Emma"]
    things = ["apples", "marbles", "pencils", "cookies", "stickers", "books"]
    for i in range(30):
        n, t = rng.choice(names), rng.choice(things)
        a, b = rng.randint(2, 9), rng.randint(1, 5)
        s = a + b
        near = [str(x) for x in {s - 2, s - 1, s + 1, s + 2, a, b} if x > 0 and x != s]
        add("word_problem", i, f"{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?",
            str(s), _distractors(rng, str(s), near, 3))
    raw = _dedupe(raw, key=lambda it: it["question"] + "|" + it["_correct"])
    items = _balance(rng, raw, "choices", "answer")
    shot_ids = []
    for src, ans in zip(("science", "which_class", "element"), (2, 0, 1)):
        it = next(x for x in items if x["source"] == src and x["answer"] == ans and x["id"] not in shot_ids)
        shot_ids.append(it["id"])
    train, test = _split_shots(items, shot_ids)
    return {"train": train, "test": test}


def _dedupe(raw: list[dict], key) -> list[dict]:
    seen, out = set(), []
    for it in raw:
        k = key(it)
        if k in seen:
            continue
        seen.add(k)
        out.append(it)
    return out


BUILDERS = {"mini_mmlu": build_mini_mmlu, "mini_hellaswag": build_mini_hellaswag, "mini_arc": build_mini_arc}


def generate_all(seed: int = SEED) -> dict[str, dict[str, list[dict]]]:
    """Every mini task's splits.

    Args:
        seed: the generator's seed.

    Returns:
        Task -> split -> items."""
    return {name: BUILDERS[name](seed) for name in TASKS}


def _dumps(items: list[dict]) -> str:
    return "".join(json.dumps(it, ensure_ascii=False, sort_keys=True) + "\n" for it in items)


def data_file(task: str, split: str, data_dir: Path = DATA) -> Path:
    """The file of a task's split (``<task>_<split>.jsonl``).

    Args:
        task: the task.
        split: the split.
        data_dir: the data folder.

    Returns:
        Its path."""
    return data_dir / f"{task}_{split}.jsonl"


def write_all(data_dir: Path = DATA, seed: int = SEED) -> list[Path]:
    """Write every task's splits as JSON lines.

    Args:
        data_dir: the data folder.
        seed: the generator's seed.

    Returns:
        The files written."""
    data_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for task, splits in generate_all(seed).items():
        for split, items in splits.items():
            p = data_file(task, split, data_dir)
            p.write_text(_dumps(items), encoding="utf-8")
            written.append(p)
    return written


def check(data_dir: Path = DATA, seed: int = SEED) -> list[str]:
    """Data files that differ from what the generator produces now.

    Args:
        data_dir: the data folder.
        seed: the generator's seed.

    Returns:
        Their names; empty when up to date."""
    stale = []
    for task, splits in generate_all(seed).items():
        for split, items in splits.items():
            p = data_file(task, split, data_dir)
            if not p.exists() or p.read_text(encoding="utf-8") != _dumps(items):
                stale.append(p.name)
    return stale


def main(argv=None) -> int:
    """``python -m hif8qat.evaluate.minitasks.generate`` rewrites ``data/``; ``--check`` verifies the committed files
    are
    up to date.

    Args:
        argv: the arguments (default sys.argv[1:]).

    Returns:
        The exit status: 1 when ``--check`` finds stale files."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only verify the committed data files")
    ap.add_argument("--out", type=Path, default=DATA)
    args = ap.parse_args(argv)
    if args.check:
        stale = check(args.out)
        if stale:
            print("stale mini-task data (rerun python -m hif8qat.evaluate.minitasks.generate):", ", ".join(stale))
            return 1
        print("mini-task data up to date")
        return 0
    for p in write_all(args.out):
        n = sum(1 for _ in p.open(encoding="utf-8"))
        print(f"{p.relative_to(HERE)}: {n} items")
    return 0


if __name__ == "__main__":
    sys.exit(main())
