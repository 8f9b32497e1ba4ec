"""Datasets of the paper tasks: local copies through generated task YAMLs, and a fail-fast check of the rest
(see "Datasets for the paper tasks without internet" in :mod:`hif8qat.evaluate`); and the settings under which lm-eval
builds its tasks faster with the same documents and prompts (dataset cards, templates, subsets)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import huggingface_hub.constants as hconst
import yaml

from hif8qat.config.eval_tasks import TaskSpec
from hif8qat.errors import RunError
from hif8qat.runs.downloads import hub_reachable

LOCAL_DATA_ENV = "HIF8QAT_LM_EVAL_DATA"


class DatasetUnavailableError(RunError):
    """A paper task's dataset is neither on disk, in the datasets cache, nor reachable on the hub."""


def lm_eval_task_dirs(specs: Iterable[TaskSpec]) -> list[Path] | None:
    """lm-eval's own YAML folders for the paper tasks. Indexing only these folders takes a second; lm-eval's full
    index (~15k YAMLs) takes 10-90 s here.

    Args:
        specs: the tasks.

    Returns:
        The folders; None (index everything) when a task has no folder."""
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).resolve().parent
    dirs: list[Path] = []
    for s in specs:
        if s.mini:
            continue
        if s.lm_eval_dir is None:
            return None
        d = root / s.lm_eval_dir
        if d not in dirs:
            dirs.append(d)
    return dirs


def _lm_eval_task_index():
    """Adapter: lm-eval's task index module (``TaskIndex`` builds the index of chosen task folders; ``Kind`` tells a
    task from a group or a tag). lm-eval keeps it private (``lm_eval.tasks._index``); its public ``TaskManager``
    indexes every task it ships (seconds), where the paper's tasks need their own folders only.

    Returns:
        The ``lm_eval.tasks._index`` module."""
    from lm_eval.tasks import _index

    return _index


def task_index_for(specs: Iterable[TaskSpec]) -> Mapping[str, Any]:
    """lm-eval's task index over the folders of :func:`lm_eval_task_dirs` (the full index when it gives none).

    Args:
        specs: the tasks.

    Returns:
        Task name -> its index entry."""
    dirs = lm_eval_task_dirs(specs)
    if dirs is None:
        from lm_eval.tasks import TaskManager

        return TaskManager().task_index
    return _lm_eval_task_index().TaskIndex.build(dirs)


def _leaf_tasks(name: str, index: Mapping[str, Any], _seen: set[str] | None = None) -> list[str]:
    """Leaf task names under a task/group/tag name in lm-eval's task index."""
    Kind = _lm_eval_task_index().Kind  # noqa: N806 - lm-eval's enum, under its own name
    _seen = set() if _seen is None else _seen
    if name in _seen:
        return []
    _seen.add(name)
    entry = index.get(name)
    if entry is None:
        return []
    if entry.kind in (Kind.TASK, Kind.PY_TASK):
        return [name]
    members: list[str] = []
    if entry.kind == Kind.TAG:
        members = sorted(entry.tags)
    elif entry.kind == Kind.GROUP:
        members = _group_members((entry.cfg or {}).get("task", []))
    out: list[str] = []
    for m in members:
        out.extend(_leaf_tasks(m, index, _seen))
    return out


def _group_members(items) -> list[str]:
    """Task/tag names in a group's ``task:`` list; inline subgroups (``{group: stem, task: [...]}``, as in
    ``mmlu_continuation``) are flattened."""
    out: list[str] = []
    for m in items if isinstance(items, list) else [items]:
        if isinstance(m, str):
            out.append(m)
        elif isinstance(m, Mapping):
            out.extend(_group_members(m.get("task", [])))
    return out


def _local_dataset_map(local_datasets: Mapping[str, str | os.PathLike] | None) -> dict[str, Path]:
    out = {k: Path(v).expanduser() for k, v in (local_datasets or {}).items()}
    for k, p in out.items():
        if not p.exists():
            raise DatasetUnavailableError(f"eval.local_datasets[{k!r}] = {p} does not exist")
    return out


def _offline_env() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


@contextlib.contextmanager
def _forced_offline():
    """Make datasets/huggingface_hub fail fast instead of retrying an unreachable hub."""
    import datasets.config as dcfg

    saved = (dcfg.HF_HUB_OFFLINE, hconst.HF_HUB_OFFLINE, os.environ.get("HF_DATASETS_OFFLINE"))
    dcfg.HF_HUB_OFFLINE = hconst.HF_HUB_OFFLINE = True
    if hasattr(dcfg, "HF_DATASETS_OFFLINE"):
        dcfg.HF_DATASETS_OFFLINE = True
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        yield
    finally:
        dcfg.HF_HUB_OFFLINE, hconst.HF_HUB_OFFLINE = saved[0], saved[1]
        if hasattr(dcfg, "HF_DATASETS_OFFLINE"):
            dcfg.HF_DATASETS_OFFLINE = saved[0]
        if saved[2] is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)
        else:
            os.environ["HF_DATASETS_OFFLINE"] = saved[2]


@contextlib.contextmanager
def libyaml_safe_load() -> Iterator[None]:
    """Within it, ``yaml.safe_load`` parses with libyaml's C parser (the same safe constructors) where PyYAML has it.

    datasets parses a local copy's dataset card (its README's YAML header) with ``yaml.safe_load`` each time it loads
    one of its configs: 57 times per evaluation for MMLU's subjects, whose card lists them all. PyYAML's pure-Python
    parser made that about a third of an evaluation's 12 s of setup (lm-eval building its tasks) on the AMX Xeon;
    neither datasets nor huggingface_hub take another loader. Restored on exit."""
    c_loader = getattr(yaml, "CSafeLoader", None)
    python_safe_load = yaml.safe_load
    if c_loader is not None:
        yaml.safe_load = lambda stream: yaml.load(stream, Loader=c_loader)
    try:
        yield
    finally:
        yaml.safe_load = python_safe_load


@contextlib.contextmanager
def compiled_jinja_templates() -> Iterator[None]:
    """Within it, lm-eval compiles each of its tasks' Jinja templates once, not once per document and field.

    lm-eval's ``apply_template`` compiles the template string at every call (``Environment.from_string`` keeps no
    cache): about 3,500 compilations per mini evaluation, for a few dozen distinct templates. The replacement
    compiles each distinct string once, in lm-eval's own environment (its filters, strict undefined names), and
    renders it the same way. Restored on exit."""
    import lm_eval.utils

    lm_eval_apply_template = lm_eval.utils.apply_template
    compiled: dict[str, Any] = {}

    def apply_template(template: str, doc: dict) -> str:
        if template not in compiled:
            compiled[template] = lm_eval.utils.env.from_string(template)
        return compiled[template].render(**doc)

    lm_eval.utils.apply_template = apply_template
    try:
        yield
    finally:
        lm_eval.utils.apply_template = lm_eval_apply_template


@contextlib.contextmanager
def selected_docs_only() -> Iterator[None]:
    """Adapter: within it, lm-eval's ``Task.doc_iterator`` given ``samples`` formats only the selected documents.

    lm-eval (0.4.13) picks ``samples`` by formatting every document of the split into a dict and keeping those whose
    index is listed, twice per evaluation (building the requests, logging the samples): about 50,000 rows for the
    mini profile's 501 documents (MMLU's 14,042, HellaSwag's 10,042), seconds of its setup. lm-eval has no setting
    for it. The replacement yields the listed documents by index, in the same (enumeration, document) pairs and
    rank slices; a list that is not sorted, unique and in range goes to lm-eval's own method. Restored on exit."""
    from lm_eval.api.task import Task
    from lm_eval.utils import create_iterator

    lm_eval_doc_iterator = Task.doc_iterator
    log = logging.getLogger("lm_eval.api.task")

    def doc_iterator(self, *, rank: int = 0, limit: int | None = None, world_size: int = 1,
                     samples: list[int] | None = None):
        docs = self.eval_docs
        if not samples or list(samples) != sorted(set(samples)) or samples[0] < 0 or samples[-1] >= len(docs):
            return lm_eval_doc_iterator(self, rank=rank, limit=limit, world_size=world_size, samples=samples)
        log.info(f"{self.config.task}: Evaluating on {len(samples)} examples")
        return create_iterator(enumerate(docs[i] for i in samples), rank=int(rank), limit=None,
                               world_size=int(world_size))

    Task.doc_iterator = doc_iterator
    try:
        yield
    finally:
        Task.doc_iterator = lm_eval_doc_iterator


def card_header(folder: Path) -> Mapping[str, Any] | None:
    """The YAML header of a hub-style local copy's dataset card (its README.md).

    Args:
        folder: the local copy.

    Returns:
        The header; None without a card or a readable header."""
    readme = Path(folder) / "README.md"
    if not readme.is_file():
        return None
    text = readme.read_text(encoding="utf-8")
    if not text.startswith("---"):
        return None
    try:
        meta = yaml.load(text.split("---", 2)[1], Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
    except yaml.YAMLError:
        return None
    return meta if isinstance(meta, Mapping) else None


def _card_config(card: Mapping[str, Any] | None, config_name: str | None) -> Mapping[str, Any] | None:
    for cfg in (card or {}).get("configs") or []:
        if isinstance(cfg, Mapping) and cfg.get("config_name", "default") == (config_name or "default"):
            return cfg
    return None


def local_splits(folder: Path, config_name: str | None, card: Mapping[str, Any] | None = None) -> set[str] | None:
    """Splits a hub-style local copy declares for a config (its README ``configs:`` block).

    Args:
        folder: the local copy.
        config_name: the config (None: the default).
        card: the copy's :func:`card_header`, when already read (None: read here).

    Returns:
        The split names; None when unknown."""
    cfg = _card_config(card if card is not None else card_header(folder), config_name)
    files = None if cfg is None else cfg.get("data_files")
    if not isinstance(files, list):
        return None
    return {f["split"] for f in files if isinstance(f, Mapping) and "split" in f}


def local_parquet_files(folder: Path, config_name: str | None,
                        card: Mapping[str, Any] | None) -> dict[str, list[str]] | None:
    """A config's parquet files per split, when the card names each file and declares no features.

    Then datasets' packaged ``parquet`` loader reads exactly the rows, in the same order and with the same
    features (the files' own), as loading the folder by name: the folder's card would otherwise be parsed again
    and its every config (MMLU's 57) hashed on each of the 57 loads of a paper MMLU evaluation.

    Args:
        folder: the local copy.
        config_name: the config (None: the default).
        card: the copy's :func:`card_header`.

    Returns:
        Split -> absolute file paths; None where the folder must be loaded by name (glob patterns, other
        formats, features or a ``.huggingface.yaml`` that could change what datasets builds)."""
    cfg = _card_config(card, config_name)
    files = None if cfg is None else cfg.get("data_files")
    if not isinstance(files, list) or not files or (Path(folder) / ".huggingface.yaml").exists():
        return None
    infos = (card or {}).get("dataset_info")
    for info in infos if isinstance(infos, list) else [infos]:
        if isinstance(info, Mapping) and "features" in info \
                and info.get("config_name", "default") == (config_name or "default"):
            return None
    out: dict[str, list[str]] = {}
    for f in files:
        paths = f.get("path") if isinstance(f, Mapping) else None
        paths = [paths] if isinstance(paths, str) else paths
        if not isinstance(f, Mapping) or not isinstance(f.get("split"), str) or not isinstance(paths, list):
            return None
        for rel in paths:
            file = Path(folder) / str(rel)
            if file.suffix != ".parquet" or any(c in str(rel) for c in "*?[") or not file.is_file():
                return None
            out.setdefault(f["split"], []).append(str(file.resolve()))
    return out


def prepare_paper_tasks(
    specs: list[TaskSpec],
    local_datasets: Mapping[str, str | os.PathLike] | None,
    workdir: Path,
    *,
    index: Mapping[str, Any] | None = None,
    check: bool = True,
    data_root: str | os.PathLike | None = None,
) -> tuple[list[Path], bool]:
    """Write override YAMLs for paper tasks with a local dataset copy and check the rest can be loaded.

    A dataset is looked up in ``local_datasets`` (hub id or task name), then under ``$HIF8QAT_LM_EVAL_DATA``,
    then under ``data_root``. When the local copy has no train split and the task takes its few-shot examples from it
    (HellaSwag, ARC; the offline copies ship none), the override also sets ``training_split: null``, so lm-eval's own
    fallback picks the few-shot source: the validation split (ARC: disjoint from test; HellaSwag: the evaluated
    split, with the evaluated document excluded from its own context by lm-eval's sampler).

    Args:
        specs: the tasks (mini tasks are skipped).
        local_datasets: hub id or task name -> local copy.
        workdir: where the override YAMLs go.
        index: lm-eval's task index (None: built here).
        check: whether to check that every other dataset can be loaded.
        data_root: the offline benchmark copies of :mod:`hif8qat.evaluate.offline_benchmarks`.

    Returns:
        ``(extra include paths, whether evaluation must run with the hub forced offline)``.

    Raises:
        DatasetUnavailableError: a dataset with no local copy, no cache and no hub."""
    paper = [s for s in specs if not s.mini]
    if not paper:
        return [], False
    if index is None:
        index = task_index_for(paper)
    local = _local_dataset_map(local_datasets)
    roots = [Path(r) for r in (os.environ.get(LOCAL_DATA_ENV), data_root) if r]
    override_dir = workdir / "task_overrides"
    written = 0
    cards: dict[Path, Mapping[str, Any] | None] = {}  # one read of each copy's card for all its configs
    unresolved: dict[str, tuple[str, str | None]] = {}  # dataset_path -> (first leaf, dataset_name)
    for spec in paper:
        leaves = _leaf_tasks(spec.name, index)
        if not leaves:
            raise ValueError(f"lm-eval has no task named {spec.name!r}")
        for leaf in leaves:
            entry = index[leaf]
            cfg = entry.cfg or {}
            ds_path = cfg.get("dataset_path")
            if not ds_path:
                continue
            target = local.get(leaf) or local.get(spec.name) or local.get(ds_path)
            if target is None:
                target = next((r / ds_path for r in roots if (r / ds_path).exists()), None)
            if target is not None:
                override_dir.mkdir(parents=True, exist_ok=True)
                target = Path(target).resolve()
                if target not in cards:
                    cards[target] = card_header(target)
                text = (f"# generated by hif8qat.evaluate: {leaf} on a local copy of {ds_path}, {target}\n"
                        f"include: {json.dumps(str(Path(entry.yaml_path).resolve()))}\n"
                        f"task: {json.dumps(leaf)}\n")
                parquet = None if cfg.get("dataset_kwargs") else \
                    local_parquet_files(target, cfg.get("dataset_name"), cards[target])
                if parquet is None:
                    text += f"dataset_path: {json.dumps(str(target))}\n"
                else:  # the same rows as the folder by name, without its card's cost (local_parquet_files)
                    text += ("dataset_path: parquet\ndataset_name: null\n"
                             f"dataset_kwargs: {json.dumps({'data_files': parquet})}\n")
                splits = local_splits(target, cfg.get("dataset_name"), cards[target])
                train = cfg.get("training_split")
                if splits is not None and train and train not in splits and not cfg.get("fewshot_split"):
                    text += "training_split: null\n"
                (override_dir / f"{leaf}.yaml").write_text(text)
                written += 1
            elif ds_path not in unresolved:
                unresolved[ds_path] = (leaf, cfg.get("dataset_name"))
    force_offline = False
    if unresolved and check:
        online = not _offline_env() and hub_reachable()
        if not online:
            force_offline = True
            missing = []
            with _forced_offline():
                import datasets

                for ds_path, (leaf, ds_name) in unresolved.items():
                    try:
                        datasets.load_dataset(ds_path, ds_name)
                    except Exception as err:  # noqa: BLE001 - any failure means "not available"
                        missing.append(f"  {ds_path} (task {leaf}): {type(err).__name__}: {str(err)[:160]}")
            if missing:
                raise DatasetUnavailableError(
                    "lm-eval datasets not available: the hub is unreachable"
                    + (" (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE set)" if _offline_env() else "")
                    + " and there is no local or cached copy of:\n" + "\n".join(missing)
                    + f"\nProvide a copy of each hub dataset repo and set {LOCAL_DATA_ENV}=<root> (laid out as "
                    "<root>/<hub id>, e.g. <root>/cais/mmlu) or eval.local_datasets={<hub id>: <dir>}; "
                    "or run the mini tasks (eval.tasks=mini)."
                )
    return ([override_dir] if written else []), force_offline
