"""Run folders: where a run lives, what it records about itself, and how reruns treat it.

Layout (one folder per run, never shared; docs/design.md describes the whole lifecycle):
    results/runs/<profile>/<experiment>/seed<k>[-<tag>]/
        run.lock  config_resolved.yaml  run_info.json  metrics.jsonl  telemetry/  checkpoints/  export/  eval/
        summary.json  DONE
One process writes a folder at a time: it holds an OS lock (flock) on ``run.lock`` for as long as it lives,
released by the OS even on kill -9. A finished run (DONE present) is skipped unless forced, and only if it was
trained with the same settings; forcing keeps the old folder under a new name (``<name>.old-<time>``), so
nothing already written is lost.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from hif8qat.artefacts import RUN_INFO_SCHEMA, schema_problem
from hif8qat.compute_dtype import describe, training_device_type
from hif8qat.config.run_config import RunConfig, check_path_name
from hif8qat.errors import RunError
from hif8qat.files import write_json, write_text
from hif8qat.runs import host_allocator
from hif8qat.runs.checkpoint_names import checkpoint_step, latest_checkpoint
from hif8qat.runs.launch_env import distributed_info, launch_differences, launch_record
from hif8qat.runs.provenance import provenance

DONE_MARKER = "DONE"
FAILED_MARKER = "FAILED"  # a diverged run's reason; removed when a rerun finishes
LOCK_FILE = "run.lock"
ARCHIVE_INFIX = ".old-"  # <run folder>.old-<time>: a run set aside by force=true; never counted as a run
_TAG_MAX = 120
CONFIG_FILE = "config_resolved.yaml"
INFO_FILE = "run_info.json"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
EXPORT_DIR = "export"
EXPORT_8BIT_DIR = "export_8bit"  # the deployable 8-bit export (stage=export), beside export/
# Settings that may differ between an interrupted run and its resumption without changing the result.
_RESUME_FREE_KEYS = {"stage", "force", "trust_unverified", "train.resume", "train.resume_allow_mismatch",
                     "train.num_threads", "train.checkpoint_every", "train.keep_checkpoints",
                     "train.keep_checkpoints_when_done", "train.log_every", "train.val_every", "data.eval_windows",
                     "quant.telemetry_dump_every", "quant.telemetry_stats_every", "logger", "eval", "results_root",
                     "run_tag"}
# Settings added after runs were already saved, with the value that does what the code did before they existed.
# A saved config without the key ran with that value, so it still matches a rerun that leaves the default.
_ADDED_SETTINGS = {"train.activation_checkpointing": False, "quant.target": None, "trust_unverified": False,
                   "train.optimizer_impl": "torch_default"}


class RunFolderError(RunError):
    """A run folder cannot be used as asked (unfinished and not resumable, ...)."""


class SettingsDiffer(RunFolderError):
    """The folder holds a run trained with other settings: resuming or skipping it would mix two runs."""


class CorruptRunFile(RunFolderError):
    """A run-folder file that decides what a rerun does (config_resolved.yaml, run_info.json) is unreadable."""


class RunFolderBusy(RunFolderError):
    """Another live process holds the run folder's lock."""


def sanitize_tag(text: str) -> str:
    """A run tag safe as part of a folder name; a long one is cut and keeps a hash of the whole.

    Args:
        text: the tag as given.

    Returns:
        The tag."""
    tag = re.sub(r"[^A-Za-z0-9_.=,+-]+", "_", text).strip("_")
    if len(tag) > _TAG_MAX:  # a cut tag could name two sweep points alike: a hash of the whole keeps them apart
        tag = tag[:_TAG_MAX - 9] + "-" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return tag


def is_archive(path: Path) -> bool:
    """Whether a folder is an archived run (its name holds ``ARCHIVE_INFIX``).

    Args:
        path: the folder.

    Returns:
        True for an archive."""
    return ARCHIVE_INFIX in Path(path).name


def run_dir_for(cfg: RunConfig) -> Path:
    """The run folder ``<results_root>/<profile>/<experiment>/seed<k>[-<tag>]``; never one outside results_root.

    Args:
        cfg: the run's config.

    Returns:
        Its path (not created here).

    Raises:
        RunFolderError: results_root is empty.
        ConfigError: the profile or experiment name is not a safe folder name."""

    # The config checked these already; checked again where the path is made, so no caller that built a
    # RunConfig another way can write outside results_root (a symlink placed there by the user is followed).
    if not str(cfg.results_root).strip():
        raise RunFolderError("results_root is empty: name the folder that holds the runs (default results/runs)")
    check_path_name("profile.name", cfg.profile.name)
    check_path_name("experiment.name", cfg.experiment.name)
    name = f"seed{int(cfg.seed)}" + (f"-{sanitize_tag(cfg.run_tag)}" if cfg.run_tag else "")
    return Path(cfg.results_root) / cfg.profile.name / cfg.experiment.name / name


def saved_optimizer_impl(cfg: RunConfig) -> str | None:
    """The AdamW implementation recorded by the run folder that cfg resumes or finds finished; a config saved
    before the setting existed ran torch's default.

    Args:
        cfg: the run's config.

    Returns:
        The implementation, or None for a new run, force=true or no readable saved config."""
    config = None if cfg.force else _load_config(run_dir_for(cfg) / CONFIG_FILE)
    if config is None:
        return None
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    return train.get("optimizer_impl", _ADDED_SETTINGS["train.optimizer_impl"])


def is_done(run_dir: Path) -> bool:
    """Whether the run finished (its DONE marker exists).

    Args:
        run_dir: the run folder.

    Returns:
        True when finished."""
    return (run_dir / DONE_MARKER).exists()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key not in ("algo", "interval", "target", "num_fewshot", "local_datasets"):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _flat_differences(fa: dict[str, Any], fb: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Every flattened setting that differs between two saved configs.

    Args:
        a: one config as a dict.
        b: the other.

    Returns:
        The differences, one line each."""
    return _flat_differences(_flatten(a), _flatten(b))


# ------------------------------------------------------------------------------------------- pairing
# Settings two runs may differ in and still be a fair pair: what names the run, and what never changes training.
_PAIRING_FREE_KEYS = _RESUME_FREE_KEYS | {"experiment", "run_tag", "seed"}


def _free(key: str, prefixes: Any) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def training_differences(a: dict[str, Any], b: dict[str, Any], *, may_differ: Any = ()) -> list[str]:
    """Flattened settings that differ between two saved configs and change what training does.

    Ignored: the experiment's name and description, run_tag, seed (checked on its own), logging, evaluation
    and checkpoint cadence. A setting one config lacks is read with the value it had before it existed.

    Args:
        a: one config as a dict.
        b: the other.
        may_differ: prefixes also ignored (``quant`` for a BF16 baseline).

    Returns:
        The differing keys."""
    fa, fb = _flatten(a), _flatten(b)
    for key, old_behaviour in _ADDED_SETTINGS.items():
        fa.setdefault(key, old_behaviour)
        fb.setdefault(key, old_behaviour)
    free = set(_PAIRING_FREE_KEYS) | set(may_differ)
    return [k for k in _flat_differences(fa, fb) if not _free(k, free)]


def _load_config(path: Path) -> dict[str, Any] | None:
    try:
        # libyaml's loader when built: the pure-Python one dominates a report over dozens of runs
        cfg = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _run_info_or_empty(run_dir: Path) -> dict[str, Any]:
    try:
        info = json.loads((run_dir / INFO_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return info if isinstance(info, dict) else {}


def find_baseline_run(results_root: Path, profile: str, baseline_experiment: str, run_dir: Path, *,
                      may_differ: Any = ("quant",)) -> tuple[Path | None, str]:
    """The run of ``baseline_experiment`` that ``run_dir`` is compared with.

    The pair must share the seed and every training-relevant setting of ``config_resolved.yaml``
    (:func:`training_differences`). Candidates are ``<results_root>/<profile>/<baseline>/seed*``, never an
    archived ``.old-`` folder; among equal matches a finished run wins, then an untagged one.

    Args:
        results_root: the folder that holds the runs.
        profile: the profile's name.
        baseline_experiment: the experiment to pair with.
        run_dir: the run to pair.
        may_differ: prefixes allowed to differ: ``quant`` for a BF16 baseline, an experiment's declared ``changes`` for
            the one it derives from.

    Returns:
        ``(folder, "")``, or ``(None, why there is none)``."""
    cfg = _load_config(Path(run_dir) / CONFIG_FILE)
    if cfg is None:
        return None, f"{run_dir} has no readable {CONFIG_FILE}"
    folder = Path(results_root) / profile / str(baseline_experiment)
    cands = sorted(d for d in folder.glob("seed*") if d.is_dir() and not is_archive(d))
    if not cands:
        return None, f"{baseline_experiment} has no run under {folder}"
    matches, rejected, seeds = [], [], set()
    for d in cands:
        other = _load_config(d / CONFIG_FILE)
        if other is None:
            rejected.append(f"{d.name}: no readable {CONFIG_FILE}")
            continue
        seeds.add(other.get("seed"))
        if other.get("seed") != cfg.get("seed"):
            continue
        diff = training_differences(cfg, other, may_differ=may_differ) or launch_differences(
            _run_info_or_empty(Path(run_dir)), _run_info_or_empty(d))
        if diff:
            rejected.append(f"{d.name} differs in {', '.join(diff)}")
        else:
            matches.append(d)
    if matches:
        return sorted(matches, key=lambda d: (not is_done(d), "-" in d.name, d.name))[0], ""
    why = f"{baseline_experiment} has no run with seed {cfg.get('seed')} and the same training settings"
    details = rejected or [f"its seeds: {', '.join(str(s) for s in sorted(seeds, key=str))}"]
    return None, f"{why} ({'; '.join(details)})"


# ------------------------------------------------------------------------------------------- one writer
_HELD_LOCKS: dict[str, Any] = {}  # run folder (real path) -> open lock file, held until release or exit


def lock_run_dir(run_dir: Path) -> None:
    """Take the folder's lock for this process. Idempotent.

    An flock belongs to the open file, so the OS drops it when the process dies, kill -9 included: a stale
    lock file never blocks a rerun. Under torchrun only rank 0 calls this (see run.py).

    Args:
        run_dir: the run folder.

    Raises:
        RunFolderBusy: another process holds the lock (the error names it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(run_dir)
    if key in _HELD_LOCKS:
        return
    path = run_dir / LOCK_FILE
    while True:
        fh = open(path, "a+")  # noqa: SIM115 - held open on purpose for the life of the process
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "pid unknown"
            fh.close()
            raise RunFolderBusy(f"{run_dir} is in use by another process ({holder}); one process writes a run "
                                "folder at a time: wait for it to finish or stop it, then run again") from None
        except OSError as err:  # a filesystem without flock support (some network mounts)
            fh.close()
            print(f"warning: cannot lock {path} ({err}); nothing stops a second process from writing this "
                  "run folder at the same time", file=sys.stderr)
            return
        # If force=true renamed the folder between our open and flock, the lock guards the archive: retry.
        try:
            same = os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        fh.close()
        run_dir.mkdir(parents=True, exist_ok=True)
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    fh.flush()
    _HELD_LOCKS[key] = fh


def release_run_dir(run_dir: Path) -> None:
    """Release this process's lock on the folder, if it holds one (the lock file stays).

    Args:
        run_dir: the run folder."""
    fh = _HELD_LOCKS.pop(os.path.realpath(run_dir), None)
    if fh is not None:
        fh.close()  # the lock file stays: removing it could let two processes lock two different files


def has_export(run_dir: Path) -> bool:
    """Whether a finished run's trained weights, which evaluation reads, are there (export/ is written last,
    atomically).

    Args:
        run_dir: the run folder.

    Returns:
        True when ``export/config.json`` exists."""
    return (run_dir / EXPORT_DIR / "config.json").exists()


def _reexport_or_refuse(run_dir: Path, resume: str) -> str:
    """A folder marked finished whose export/ is gone is not finished: finish it again from its final
    checkpoint (the trainer resumes at the last step, trains nothing, and exports), or say what to run."""


    last = latest_checkpoint(run_dir / "checkpoints")
    if last is not None and resume != "never":
        print(f"{run_dir} is marked finished but has no {EXPORT_DIR}/: writing it again from the checkpoint of "
              f"step {checkpoint_step(last)}")
        return "resume"
    raise RunFolderError(f"{run_dir} is marked finished but has no {EXPORT_DIR}/ (the trained weights that "
                         "evaluation reads) and no checkpoint to write it from; train it again with force=true "
                         "(the old folder is kept, renamed)")


# What the run writes by building a folder beside its final name and renaming it there: a symlink at any of
# them would be followed into, or removed from, a place outside the run folder.
STAGING_NAMES = (EXPORT_DIR, EXPORT_DIR + ".tmp", EXPORT_8BIT_DIR, EXPORT_8BIT_DIR + ".tmp")


def refuse_staging_links(run_dir: Path) -> None:
    """Refuse a run folder where a folder the run replaces as a whole is a symbolic link; nothing is followed or
    removed (checked before any training, so hours of it never end at the export).

    Args:
        run_dir: the run folder.

    Raises:
        RunFolderError: naming the link."""
    for name in STAGING_NAMES:
        path = Path(run_dir) / name
        if path.is_symlink():
            raise RunFolderError(f"{path} is a symbolic link (to {os.readlink(path)}), where the run writes a "
                                 "folder of its own and replaces it whole; remove the link (the folder it points "
                                 "to is left alone) and run again. Nothing was followed or removed")


def _has_run_files(run_dir: Path) -> bool:
    return run_dir.exists() and any(p.name != LOCK_FILE for p in run_dir.iterdir())


def _archive(run_dir: Path) -> Path:
    """Set a run folder aside (force=true) and lock the fresh folder that replaces it."""
    target = run_dir.with_name(f"{run_dir.name}{ARCHIVE_INFIX}{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(target)
    release_run_dir(run_dir)
    lock_run_dir(run_dir)
    return target


def _read_saved_config(path: Path) -> dict[str, Any]:
    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        saved = err
    if not isinstance(saved, dict):
        reason = f"{type(saved).__name__}: {str(saved)[:200]}" if isinstance(saved, Exception) else "not a mapping"
        raise CorruptRunFile(f"{path} is unreadable ({reason}); it records the settings the run was trained "
                             "with. Restore it, or start the run again with force=true (the folder is kept, "
                             "renamed)")
    return saved


def load_run_config(run_dir: Path) -> RunConfig:
    """The RunConfig a run folder's saved config records, read back and checked as run.py checks one (a setting
    added since the run was saved takes the value that does what the code did before it existed).

    Args:
        run_dir: the run folder.

    Returns:
        The run's configuration.

    Raises:
        CorruptRunFile: the saved config is unreadable.
        ConfigError: a saved setting is invalid."""
    saved = _read_saved_config(Path(run_dir) / CONFIG_FILE)
    for key, old_behaviour in _ADDED_SETTINGS.items():
        *sections, name = key.split(".")
        section = saved
        for part in sections:
            section = section.setdefault(part, {})
        section.setdefault(name, old_behaviour)
    return RunConfig.from_dict(saved, check_paths=False)


def _read_run_info(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        info = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        info = err
    if isinstance(info, dict):  # a wrongly typed history would fail the next start's append
        problem = schema_problem(info, RUN_INFO_SCHEMA)
        info = info if problem is None else ValueError(problem)
    if not isinstance(info, dict):
        raise CorruptRunFile(f"{path} is unreadable ({str(info)[:200]}); it holds the run's history of "
                             "starts. Restore or delete it, or start the run again with force=true (the folder "
                             "is kept, renamed)")
    return info


def _check_same_settings(run_dir: Path, cfg: RunConfig, what: str) -> None:
    config_path = run_dir / CONFIG_FILE
    if not config_path.exists():
        return
    saved = _flatten(_read_saved_config(config_path))
    for key, old_behaviour in _ADDED_SETTINGS.items():
        saved.setdefault(key, old_behaviour)
    current = _flatten(cfg.to_dict())
    diff = [k for k in _flat_differences(saved, current)
            if not any(k == p or k.startswith(p + ".") for p in _RESUME_FREE_KEYS)]
    if diff:
        raise SettingsDiffer(f"cannot {what} {run_dir}: settings differ from the saved run in {config_path.name} "
                             f"({', '.join(diff)}); use force=true to start again (the folder is kept, renamed) "
                             "or run_tag=<name> for a separate folder")


def prepare_run_dir(cfg: RunConfig, *, is_main: bool = True) -> tuple[Path, str]:
    """Decide what to do with the run folder. The main process first takes the folder's lock.

    Args:
        cfg: the run's config.
        is_main: whether this is rank 0 (which locks and checks the folder).

    Returns:
        ``(path, status)``, status ``"done"``, ``"resume"`` or ``"new"``.

    Raises:
        RunFolderBusy: another process holds the lock.
        RunFolderError: an unfinished folder that may not be resumed.
        SettingsDiffer: a folder whose saved config differs in a setting that changes the training result.
        CorruptRunFile: an unreadable config_resolved.yaml or run_info.json."""
    run_dir = run_dir_for(cfg)
    if is_main:
        lock_run_dir(run_dir)
        refuse_staging_links(run_dir)
    config_path = run_dir / CONFIG_FILE
    info_path = run_dir / INFO_FILE
    status = "new"
    if _has_run_files(run_dir):
        if cfg.force:
            if is_main:
                print(f"force=true: keeping the previous run as {_archive(run_dir)}")
        elif is_done(run_dir):
            _check_same_settings(run_dir, cfg, "skip the finished run in")
            if has_export(run_dir):
                return run_dir, "done"
            status = _reexport_or_refuse(run_dir, cfg.train.resume)
        elif cfg.train.resume == "never":
            raise RunFolderError(f"run folder {run_dir} holds an unfinished run: set train.resume=auto to "
                                 "continue it, or force=true to start again (the old folder is kept)")
        else:
            status = "resume"
            _check_same_settings(run_dir, cfg, "resume")
            _read_run_info(info_path)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if status == "new" or not config_path.exists():
            write_text(config_path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))

        info = {"status": status, "argv": sys.argv, **provenance(),
                "numerics": describe(cfg.train.autocast, training_device_type(cfg.train.device)),
                "distributed": {**launch_record(), **distributed_info(cfg)}, "host_allocator": host_allocator.current()}
        history = _read_run_info(info_path).get("history", [])
        history.append(info)
        write_json(info_path, {**info, "history": history}, indent=2, sort_keys=True, default=str)
    return run_dir, status


def update_summary(run_dir: Path, **fields: Any) -> dict[str, Any]:
    """Merge fields into the run's summary.json and stamp it with the provenance.

    Args:
        run_dir: the run folder.
        **fields: the entries to set.

    Returns:
        The summary as written."""
    path = run_dir / SUMMARY_FILE
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary.update(fields)
    summary["provenance"] = provenance()
    write_json(path, summary, indent=2, sort_keys=True, default=str)
    return summary


def mark_done(run_dir: Path) -> None:
    """Write the DONE marker (and drop an old FAILED marker: the rerun finished).

    Args:
        run_dir: the run folder."""
    write_text(run_dir / DONE_MARKER, time.strftime("%Y-%m-%dT%H:%M:%S%z") + "\n")
    (run_dir / FAILED_MARKER).unlink(missing_ok=True)  # a rerun that finished: its old failure no longer holds


def mark_failed(run_dir: Path, reason: str) -> None:
    """Write the FAILED marker with its reason.

    Args:
        run_dir: the run folder.
        reason: why the run stopped."""
    write_text(run_dir / FAILED_MARKER, reason + "\n")


def failure_reason(run_dir: Path) -> str | None:
    """Why the run stopped (its FAILED marker).

    Args:
        run_dir: the run folder.

    Returns:
        The reason (``no reason recorded`` for an empty marker), or None for a run that did not fail."""
    try:
        return (run_dir / FAILED_MARKER).read_text(errors="replace").strip() or "no reason recorded"
    except OSError:
        return None
