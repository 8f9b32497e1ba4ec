"""Held-out text distances: per-token NLL, KL and top-1 agreement of a run against its baseline.

Accuracy on a few hundred benchmark items cannot resolve the paper's 0.2-0.6 % effects; quantization studies
report distances on text beside it (flips and KL, Dutta et al. 2024; llama.cpp's mean / p99 KL and top-1
agreement). This module computes them on a fixed held-out token set (:func:`heldout_windows`), for the run's
BF16 baseline against each evaluation mode of the run and for its quantized mode against its bf16 one, and writes
them to ``<run>/eval/heldout/`` (:func:`compute_heldout`); :mod:`hif8qat.stats.heldout` holds the statistics.

    python -m hif8qat.evaluate.heldout --run results/runs/mini/exp8/seed0 [--baseline results/runs/mini/exp7/seed0]"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from hif8qat.artefacts import CorruptArtefact, UnverifiedArtefact
from hif8qat.compute_dtype import Numerics
from hif8qat.config.numerics import run_numerics
from hif8qat.data.loader import build_eval_windows, tokenizer_fingerprint
from hif8qat.errors import RunError
from hif8qat.evaluate.heldout_set import BATCH_WINDOWS, MIN_WINDOWS, TARGET_TOKENS, heldout_window_count
from hif8qat.evaluate.loading import load_for_eval, quant_eval_meta
from hif8qat.files import sha256_file, write_bytes, write_json
from hif8qat.runs.folders import (
    find_baseline_run,
    has_export,
    load_run_config,
    lock_run_dir,
    provenance,
    release_run_dir,
)
from hif8qat.stats.heldout import SUMMARY_FILE, comparison_summary, heldout_dir, read_summary, run_label

log = logging.getLogger(__name__)

TOKENS_FILE = "tokens.csv.gz"


class HeldoutError(RunError):
    """A held-out comparison that cannot be computed as asked (no export, different tokenizers)."""


def heldout_windows(source: str, tokenizer, seq_len: int, cache_dir=None) -> torch.Tensor:
    """The fixed held-out token set of a profile: the first :func:`heldout_window_count` windows of the corpus'
    held-out split (:func:`hif8qat.data.loader.build_eval_windows`, never trained on), the same tokens for every run
    of a profile. Mini: 32 windows x 128 tokens.

    Args:
        source: data.source.
        tokenizer: the model's tokenizer.
        seq_len: the profile's train.seq_len.
        cache_dir: data.cache_dir.

    Returns:
        ``LongTensor[n, seq_len + 1]``."""

    return build_eval_windows(source, tokenizer, seq_len=seq_len, num_windows=heldout_window_count(seq_len),
                              cache_dir=cache_dir)


def windows_sha256(windows: torch.Tensor) -> str:
    """The sha256 of the windows' token ids (as int64), recorded so runs can be shown to share them.

    Args:
        windows: the token windows.

    Returns:
        The hex digest."""
    return hashlib.sha256(np.ascontiguousarray(windows.cpu().numpy().astype(np.int64)).tobytes()).hexdigest()


def pair_name(reference: str, other: str) -> str:
    """A comparison's name: ``<other>_vs_<reference>``.

    Args:
        reference: the reference model's name.
        other: the other's.

    Returns:
        The name."""
    return f"{other}_vs_{reference}"


def token_nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position.

    Args:
        logp: log-probabilities ``[..., V]``.
        targets: token ids ``[...]``.

    Returns:
        The NLLs ``[...]``."""
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl_and_top1(logp_ref: torch.Tensor, logp_other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(P_ref || P_other) per position (nats; summed in float64 so a tiny divergence is not lost to rounding)
    and whether the most likely next tokens agree.

    Args:
        logp_ref: the reference's log-probabilities ``[..., V]``.
        logp_other: the other's.

    Returns:
        ``(KL [...] float64, agreement [...] bool)``."""
    kl = (logp_ref.exp() * (logp_ref - logp_other)).double().sum(-1)
    return kl, logp_ref.argmax(-1) == logp_other.argmax(-1)


@torch.inference_mode()
def stream_token_stats(models: Mapping[str, torch.nn.Module], pairs: Sequence[tuple[str, str]],
                       windows: torch.Tensor, *, numerics: Numerics | None = None, device: str = "cpu",
                       batch_windows: int = BATCH_WINDOWS) -> dict[str, np.ndarray]:
    """Per predicted token of ``windows``: its window, position and target, each model's NLL and per pair the KL
    and top-1 agreement. Models are forwarded batch by batch of windows and only these per-token values are kept,
    never the logits.

    Args:
        models: name -> model.
        pairs: (reference, other) model names.
        windows: ``[n, L + 1]`` token ids (inputs ``[:, :-1]``, targets ``[:, 1:]``).
        numerics: the evaluation's resolved :class:`Numerics`, every forward runs under it (None: FP32).
        device: where to forward.
        batch_windows: windows per forward.

    Returns:
        Columns ``window``, ``pos``, ``target``, ``nll_<name>``, ``kl_<pair>``, ``top1_<pair>`` (:func:`pair_name`),
        window-major, float32 values."""

    numerics = numerics or Numerics("none", torch.device(device).type)
    cols: dict[str, list[np.ndarray]] = {"window": [], "pos": [], "target": []}
    n, length = windows.shape[0], windows.shape[1] - 1
    for start in range(0, n, batch_windows):
        w = windows[start:start + batch_windows].to(device)
        inputs, targets = w[:, :-1], w[:, 1:]
        logp = {}
        for name, model in models.items():
            with numerics.forward():
                logits = model(input_ids=inputs, use_cache=False).logits
            logp[name] = torch.log_softmax(logits.float(), dim=-1)
            del logits
            cols.setdefault(f"nll_{name}", []).append(token_nll(logp[name], targets).float().cpu().numpy().ravel())
        for ref, other in pairs:
            kl, agree = kl_and_top1(logp[ref], logp[other])
            cols.setdefault(f"kl_{pair_name(ref, other)}", []).append(kl.float().cpu().numpy().ravel())
            cols.setdefault(f"top1_{pair_name(ref, other)}", []).append(agree.to(torch.int8).cpu().numpy().ravel())
        rows = w.shape[0]
        cols["window"].append(np.repeat(np.arange(start, start + rows), length))
        cols["pos"].append(np.tile(np.arange(length), rows))
        cols["target"].append(targets.cpu().numpy().ravel())
        del logp
    return {k: np.concatenate(v) for k, v in cols.items()}


# ------------------------------------------------------------------------------------------------ files
def write_tokens(path: Path, columns: Mapping[str, np.ndarray]) -> None:
    """The per-token columns as gzipped CSV (float32 values printed with 9 significant digits: exact); the same
    values give the same bytes.

    Args:
        path: the file.
        columns: the columns of :func:`stream_token_stats`."""
    import pandas as pd

    df = pd.DataFrame({k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in columns.items()})
    # no name and mtime 0 in the gzip header: the same values give the same bytes, so a recomputation
    # changes no committed file
    write_bytes(path, gzip.compress(df.to_csv(index=False, float_format="%.9g").encode(), mtime=0))


def read_tokens(path: Path):
    """The per-token table of :func:`write_tokens` (float columns as float32, as computed).

    Args:
        path: the file.

    Returns:
        The table."""
    import pandas as pd

    df = pd.read_csv(path)
    for c in df.columns:
        if c.startswith(("nll_", "kl_")):
            df[c] = df[c].astype(np.float32)
    return df


def summarize_tokens(df, pairs: Sequence[tuple[str, str]], tokens_per_window: int) -> dict[str, dict]:
    """Per pair the statistics of :func:`hif8qat.stats.heldout.comparison_summary` from the token table.

    Args:
        df: the token table.
        pairs: (reference, other) model names.
        tokens_per_window: tokens per window (the block size).

    Returns:
        Pair name -> ``{reference, other, kl, summary}``."""

    out = {}
    for ref, other in pairs:
        name = pair_name(ref, other)
        out[name] = {"reference": ref, "other": other, "kl": "KL(P_reference || P_other), nats per token",
                     "summary": comparison_summary(df[f"nll_{ref}"], df[f"nll_{other}"], df[f"kl_{name}"],
                                                   df[f"top1_{name}"], tokens_per_window)}
    return out


# ------------------------------------------------------------------------------------------- one run
def _load_config(run_dir: Path) -> dict:

    p = Path(run_dir) / "config_resolved.yaml"
    if not p.exists():
        raise HeldoutError(f"{run_dir} has no config_resolved.yaml: not a run folder")
    return yaml.safe_load(p.read_text()) or {}


def _rel(path: Path, root: Path) -> str:
    try:
        return Path(os.path.relpath(Path(path).resolve(), Path(root).resolve())).as_posix()
    except ValueError:
        return Path(path).name


def _find_baseline(run_dir: Path, cfg: dict, results_root: Path) -> tuple[Path | None, str]:

    base = (cfg.get("experiment") or {}).get("baseline")
    if not base:
        return None, f"{(cfg.get('experiment') or {}).get('name')} has no baseline experiment"
    found, why = find_baseline_run(results_root, str((cfg.get("profile") or {}).get("name")), str(base), run_dir)
    return found, why


def plan(run_dir: Path, *, baseline: Path | None | bool = None, modes: Sequence[str] | None = None,
         results_root: Path | None = None) -> dict[str, Any]:
    """What a held-out comparison of ``run_dir`` would load and pair, and why a part is skipped.

    Args:
        run_dir: the run folder (its export/ is compared).
        baseline: a run folder, None (find it with :func:`hif8qat.runs.folders.find_baseline_run`), or False (no
            baseline comparison).
        modes: the run's modes to compare (default: bf16, and hif8 when the export is quantized).
        results_root: the folder that holds the runs (default: three folders above the run).

    Returns:
        ``{models: {name: (export, mode)}, pairs: [(reference, other)], baseline_run, baseline_skipped, config,
        results_root}``.

    Raises:
        HeldoutError: the run has no export."""

    run_dir = Path(run_dir)
    if not has_export(run_dir):
        raise HeldoutError(f"{run_dir} has no export/ to compare (train it first)")
    cfg = _load_config(run_dir)
    root = Path(results_root) if results_root is not None else run_dir.resolve().parents[2]
    quantized = (run_dir / "export" / "hif8qat_quant.json").exists()
    modes = [m for m in (modes or ("bf16", "hif8")) if m == "bf16" or (m == "hif8" and quantized)]
    skipped = None
    if baseline is False:
        base_dir, skipped = None, "not asked for (--no-baseline)"
    elif baseline is None:
        base_dir, skipped = _find_baseline(run_dir, cfg, root)
        skipped = skipped or None
    else:
        base_dir = Path(baseline)
    if base_dir is not None and not has_export(base_dir):
        base_dir, skipped = None, (f"baseline run {_rel(base_dir, root)} has no export/ (its weights were not "
                                   "kept): no comparison against the baseline")
    models = {m: (run_dir / "export", m) for m in modes}
    pairs = []
    if base_dir is not None:
        models = {"baseline": (base_dir / "export", "bf16"), **models}
        pairs += [("baseline", m) for m in modes]
    if "bf16" in modes and "hif8" in modes:
        pairs.append(("bf16", "hif8"))
    return {"models": models, "pairs": pairs, "baseline_run": base_dir, "baseline_skipped": skipped,
            "config": cfg, "results_root": root}


def compute_heldout(run_dir: Path, *, baseline: Path | None | bool = None, modes: Sequence[str] | None = None,
                    results_root: Path | None = None, device: str | None = None, numerics: Numerics | None = None,
                    batch_windows: int = BATCH_WINDOWS) -> dict[str, Any]:
    """Compute and write ``<run>/eval/heldout/``.

    Models: ``baseline`` (the run's BF16 baseline export, unquantized) and the run's export in its evaluation modes
    (:func:`hif8qat.evaluate.loading.load_for_eval`; hif8: frozen final scales), all under the evaluation's numerics.
    Pairs: ``<mode>_vs_baseline`` for each mode, and ``hif8_vs_bf16`` (the cost of quantized inference alone).
    Writes ``tokens.csv.gz`` (one row per predicted token: window, position, target id, ``nll_<model>``,
    ``kl_<pair>``, ``top1_<pair>``) and ``summary.json`` (per pair the statistics of
    :func:`hif8qat.stats.heldout.comparison_summary`, computed from the file as written; the windows and their
    sha256, numerics, the baseline run paired with, config and provenance). A baseline without an export
    (committed reference runs keep none) is skipped and said so in the summary.

    Args:
        run_dir: as in :func:`plan`.
        baseline: as in :func:`plan`.
        modes: as in :func:`plan`.
        results_root: as in :func:`plan`.
        device: the evaluation device when ``numerics`` is given; else it replaces the run's eval.device (default:
            the run's eval.device resolved as the eval stage does).
        numerics: the evaluation's resolved :class:`Numerics` (default: the run's, resolved from its saved config
            as the eval stage does, :func:`saved_eval_numerics`).
        batch_windows: windows per forward.

    Returns:
        The summary.

    Raises:
        HeldoutError: the run has no export."""

    t0 = time.time()
    run_dir = Path(run_dir)
    p = plan(run_dir, baseline=baseline, modes=modes, results_root=results_root)
    cfg, root = p["config"], p["results_root"]
    tr, data = cfg.get("train") or {}, cfg.get("data") or {}
    if numerics is None:
        device, numerics = saved_eval_numerics(run_dir, device)
    out = heldout_dir(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "what": "per-token held-out NLL, KL and top-1 agreement of a run against its baseline and its own modes",
        "run_dir": _rel(run_dir, root),
        "baseline_run": run_label(p["baseline_run"]) if p["baseline_run"] is not None else None,
        "baseline_dir": _rel(p["baseline_run"], root) if p["baseline_run"] is not None else None,
        "baseline_skipped": p["baseline_skipped"], "paths_relative_to": "results_root",
        "models": {name: {"export": _rel(export, root), "mode": mode} for name, (export, mode) in p["models"].items()},
        "numerics": {"device": device, "dtype": numerics.mode, **numerics.describe()},
        "config": cfg,
    }
    if not p["pairs"]:
        doc.update(comparisons={}, note="nothing to compare: no baseline export and no quantized mode")
        doc["provenance"] = provenance()
        write_json(out / SUMMARY_FILE, doc, indent=2, sort_keys=True, default=str)
        return doc
    trust = (cfg.get("model") or {}).get("trust_remote_code")
    loaded, tokenizers = {}, {}
    for name, (export, mode) in p["models"].items():
        loaded[name], tokenizers[name] = load_for_eval(export, mode, device=device, trust_remote_code=trust)

    prints = {name: tokenizer_fingerprint(t) for name, t in tokenizers.items()}
    if len(set(prints.values())) > 1:
        raise HeldoutError(f"the models compared use different tokenizers ({prints}): per-token distances "
                           "need the same vocabulary")
    seq_len = int(tr.get("seq_len"))
    tok = next(iter(tokenizers.values()))
    windows = heldout_windows(data.get("source", "mini"), tok, seq_len, data.get("cache_dir"))
    if "hif8" in loaded:

        doc["models"]["hif8"]["quant"] = quant_eval_meta(loaded["hif8"], run_dir / "export")
    cols = stream_token_stats(loaded, p["pairs"], windows, numerics=numerics, device=device,
                              batch_windows=batch_windows)
    del loaded
    write_tokens(out / TOKENS_FILE, cols)
    table = read_tokens(out / TOKENS_FILE)  # the statistics come from the file as written
    doc.update(
        windows={"source": data.get("source", "mini"), "split": "held-out", "seq_len": seq_len,
                 "n_windows": int(windows.shape[0]), "n_tokens": int(len(table)),
                 "rule": f"first max({MIN_WINDOWS}, ceil({TARGET_TOKENS} / seq_len)) windows of build_eval_windows",
                 "tokenizer_fingerprint": next(iter(prints.values())), "sha256": windows_sha256(windows)},
        tokens_file=TOKENS_FILE, tokens_sha256=sha256_file(out / TOKENS_FILE),
        comparisons=summarize_tokens(table, p["pairs"], seq_len),
        wall_time_s=round(time.time() - t0, 1), provenance=provenance())
    write_json(out / SUMMARY_FILE, doc, indent=2, sort_keys=True, default=str)
    return doc


def saved_eval_numerics(run_dir: Path, device: str | None = None, dtype: str | None = None) -> tuple[str, Numerics]:
    """The evaluation device and numerics of a run folder, from its saved config read back as a RunConfig, as the
    eval stage resolves them.

    Args:
        run_dir: the run folder.
        device: replaces the saved ``eval.device`` when given.
        dtype: replaces the saved ``eval.dtype`` when given.

    Returns:
        ``(device, numerics)``: the concrete evaluation device and its resolved :class:`Numerics`.

    Raises:
        CorruptRunFile: the saved config is unreadable.
        ConfigError: a saved setting is invalid.
        EvalSettingError: an evaluation device this machine lacks, or an unknown ``eval.device`` /
            ``eval.dtype``."""
    cfg = load_run_config(run_dir)
    evaluation = dataclasses.replace(cfg.eval, device=device or cfg.eval.device, dtype=dtype or cfg.eval.dtype)
    numerics = run_numerics(dataclasses.replace(cfg, stage="eval", eval=evaluation))
    return numerics.eval_device, numerics.eval


def after_eval(cfg, run_dir: Path, *, device: str, numerics: Numerics) -> dict | None:
    """The eval stage's hook: a quantized run's held-out comparison, once (force=true redoes it). A baseline
    without an export, or none at all, is written down in the summary and skipped; never fails the run for it.
    Redone when it lacks a mode now evaluated, or a baseline that has an export since; a redo keeps the modes
    compared before, so evaluating one mode later never drops another's comparison.

    Args:
        cfg: the run's config.
        run_dir: the run folder.
        device: the evaluation's device.
        numerics: its resolved :class:`Numerics`.

    Returns:
        The summary, or None for a run without quantization or a comparison already done."""
    if not cfg.quant.enabled:
        return None
    try:
        done = read_summary(run_dir)
    except (CorruptArtefact, UnverifiedArtefact) as err:  # a cut or unrecorded token table is not "done"
        print(f"{err.path} is corrupt, truncated or unverified: redoing the held-out comparison")
        done = None
    modes = list(cfg.eval.modes)
    if done is not None and not cfg.force:
        compared = [m for m in (done.get("models") or {}) if m != "baseline"]
        has_modes = set(modes) <= set(compared)
        modes += [m for m in compared if m not in modes]
        # done without a baseline export: redone once the baseline has one (a baseline trained afterwards)
        if has_modes and (done.get("baseline_run")
                          or plan(run_dir, results_root=Path(cfg.results_root))["baseline_run"] is None):
            print(f"{run_dir}: held-out comparison already done (force=true redoes it)")
            return None
    doc = compute_heldout(run_dir, modes=modes, results_root=Path(cfg.results_root),
                          device=device, numerics=numerics)
    print(format_summary(doc))
    return doc


# ------------------------------------------------------------------------------------------------- CLI
def format_summary(doc: Mapping[str, Any]) -> str:
    """A summary for the console: the windows, then per pair NLL difference, KL and top-1 agreement.

    Args:
        doc: the summary.

    Returns:
        The text."""
    lines = [f"held-out tokens of {doc.get('run_dir')}: baseline {doc.get('baseline_run') or '-'}"
             + (f" (skipped: {doc['baseline_skipped']})" if doc.get("baseline_skipped") else "")]
    w = doc.get("windows")
    if w:
        lines.append(f"  {w['n_tokens']} tokens in {w['n_windows']} windows of {w['seq_len']} ({w['source']}), "
                     f"numerics {doc['numerics']['device']}/{doc['numerics']['dtype']}")
    for name, c in (doc.get("comparisons") or {}).items():
        s = c["summary"]
        d, pct = s["nll_diff"], s["nll_diff_pct"]
        widen = d["se"] / d["se_iid"] if d["se_iid"] > 0 else float("nan")  # identical models: both 0
        lines.append(
            f"  {name:<20} NLL {s['nll_ref']:.4f} -> {s['nll_other']:.4f}: diff {d['mean']:+.5f} nats "
            f"(95 % CI {d['ci_lo']:+.5f} .. {d['ci_hi']:+.5f}; {pct['mean']:+.3f} % of NLL, CI {pct['ci_lo']:+.3f} "
            f".. {pct['ci_hi']:+.3f} %, MDE {pct['mde']:.3f} %; se/se_iid {widen:.2f}) | KL mean "
            f"{s['kl']['mean']:.3g} p99 {s['kl']['p99']:.3g} max {s['kl']['max']:.3g} | top-1 agreement "
            f"{100 * s['top1']['mean']:.2f} %")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m hif8qat.evaluate.heldout --run DIR [--baseline DIR | --no-baseline] [--modes M,...]``.

    Args:
        argv: the arguments (default sys.argv[1:]).

    Returns:
        The exit status: 2 for a user's error."""
    ap = argparse.ArgumentParser(prog="python -m hif8qat.evaluate.heldout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="the run folder (its export/ is compared)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--baseline", type=Path, help="the baseline run folder (default: runs.find_baseline_run)")
    g.add_argument("--no-baseline", action="store_true", help="only the run's own modes (hif8 vs bf16)")
    ap.add_argument("--modes", default=None, help="comma-separated modes of the run (default: bf16,hif8)")
    ap.add_argument("--results-root", type=Path, help="default: three folders above --run")
    ap.add_argument("--device", default=None, help="default: the run's eval.device (auto)")
    ap.add_argument("--dtype", default=None, help="default: the run's eval.dtype (auto: the training numerics)")
    ap.add_argument("--batch-windows", type=int, default=BATCH_WINDOWS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if not (args.run / "config_resolved.yaml").is_file():  # locking would create the folder
        print(f"error: --run {args.run} is not a run folder (no config_resolved.yaml); name one under "
              "<results_root>/<profile>/<experiment>/", file=sys.stderr)
        return 2
    try:
        lock_run_dir(args.run)  # eval/heldout/ is written into the run folder: one writer at a time
        try:
            device, numerics = saved_eval_numerics(args.run, args.device, args.dtype)
            doc = compute_heldout(args.run, baseline=False if args.no_baseline else args.baseline,
                                  modes=args.modes.split(",") if args.modes else None,
                                  results_root=args.results_root, device=device, numerics=numerics,
                                  batch_windows=args.batch_windows)
        finally:
            release_run_dir(args.run)
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_summary(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
