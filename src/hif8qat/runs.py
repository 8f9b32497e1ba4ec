"""Run folders: where a run lives, what it records about itself, and how reruns treat it.

Layout (one folder per run, never shared):
    results/runs/<profile>/<experiment>/seed<k>[-<tag>]/
        config_resolved.yaml  run_info.json  metrics.jsonl  telemetry/  checkpoints/  export/  eval/
        summary.json  DONE
A finished run (DONE present) is skipped unless forced; forcing keeps the old folder under a new name, so
nothing already written is lost.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from .config import ConfigError, RunConfig

DONE_MARKER = "DONE"
CONFIG_FILE = "config_resolved.yaml"
INFO_FILE = "run_info.json"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
# Settings that may differ between an interrupted run and its resumption without changing the result.
_RESUME_FREE_KEYS = {"stage", "force", "train.resume", "train.num_threads", "train.checkpoint_every",
                     "train.keep_checkpoints", "train.log_every", "train.val_every", "data.eval_windows", "quant.telemetry_dump_every", "quant.telemetry_stats_every",
                     "logger", "eval", "results_root", "run_tag"}
_TRACKED_PACKAGES = ("torch", "transformers", "lm_eval", "datasets", "hydra-core", "en_dtypes", "numpy", "hif8qat")


def sanitize_tag(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,+-]+", "_", text).strip("_")[:120]


def run_dir_for(cfg: RunConfig) -> Path:
    name = f"seed{cfg.seed}" + (f"-{sanitize_tag(cfg.run_tag)}" if cfg.run_tag else "")
    return Path(cfg.results_root) / cfg.profile.name / cfg.experiment.name / name


def is_done(run_dir: Path) -> bool:
    return (run_dir / DONE_MARKER).exists()


def git_commit(repo: Path | None = None) -> dict[str, Any]:
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def provenance() -> dict[str, Any]:
    """What any result file records so a number can be traced to the code that made it."""
    return {"git": git_commit(), "versions": package_versions(), "host": socket.gethostname(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key not in ("algo", "interval", "num_fewshot", "local_datasets"):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    fa, fb = _flatten(a), _flatten(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))


def _archive(run_dir: Path) -> Path:
    target = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(target)
    return target


def prepare_run_dir(cfg: RunConfig, *, is_main: bool = True) -> tuple[Path, str]:
    """Decide what to do with the run folder: ("done" | "resume" | "new", path).

    Raises ConfigError for an unfinished folder that may not be resumed, or one whose saved config differs
    in a setting that changes the training result.
    """
    run_dir = run_dir_for(cfg)
    config_path = run_dir / CONFIG_FILE
    status = "new"
    if run_dir.exists() and any(run_dir.iterdir()):
        if cfg.force:
            if is_main:
                print(f"force=true: keeping the previous run as {_archive(run_dir)}")
        elif is_done(run_dir):
            return run_dir, "done"
        elif cfg.train.resume == "never":
            raise ConfigError(f"run folder {run_dir} holds an unfinished run: set train.resume=auto to continue "
                              "it, or force=true to start again (the old folder is kept)")
        else:
            status = "resume"
            if config_path.exists():
                saved = yaml.safe_load(config_path.read_text())
                diff = [k for k in config_differences(saved, cfg.to_dict())
                        if not any(k == p or k.startswith(p + ".") for p in _RESUME_FREE_KEYS)]
                if diff:
                    raise ConfigError(f"cannot resume {run_dir}: settings differ from the saved run ({', '.join(diff)}); "
                                      "use force=true to start again or a different run_tag")
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if status == "new" or not config_path.exists():
            write_yaml_atomic(config_path, cfg.to_dict())
        info = {"status": status, "argv": sys.argv, **provenance()}
        info_path = run_dir / INFO_FILE
        history = json.loads(info_path.read_text()).get("history", []) if info_path.exists() else []
        history.append(info)
        write_json_atomic(info_path, {**info, "history": history})
    return run_dir, status


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)


def write_yaml_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(payload, sort_keys=False))
    os.replace(tmp, path)


def update_summary(run_dir: Path, **fields: Any) -> dict[str, Any]:
    path = run_dir / SUMMARY_FILE
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary.update(fields)
    summary["provenance"] = provenance()
    write_json_atomic(path, summary)
    return summary


def mark_done(run_dir: Path) -> None:
    (run_dir / DONE_MARKER).write_text(time.strftime("%Y-%m-%dT%H:%M:%S%z") + "\n")
