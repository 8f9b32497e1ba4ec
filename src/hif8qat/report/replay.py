"""The paper's estimators replayed on the same per-call amax traces recorded in a run's final scaler state: how
often, and by how much, each one's delayed estimate is exceeded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from safetensors.torch import load_file

from hif8qat.artefacts import verify_folder_manifest
from hif8qat.report.sources import FilesUsed, RunInfo
from hif8qat.scaling.replay import replay_rows
from hif8qat.scaling.settings import ScalingConfig

# Estimators compared on the same recorded amax traces: the paper's three candidates.
REPLAY_ESTIMATORS: dict[str, dict[str, Any]] = {
    "most_recent(30)": {"algo": "most_recent", "history_len": 30},
    "exp_smooth(30)": {"algo": "exp_smooth", "history_len": 30},
    "max(64)": {"algo": "max", "history_len": 64},
}
_EXPORT_REDO = ("Write the run's export again (delete export/ and rerun the run with stage=all) or move the run "
                "out of the results folder")
# Scaled values above 128 leave HiF8's 2-bit-mantissa tier: amax/estimate > 128/15 costs two mantissa bits.
_TWO_BIT_TIER_RATIO = 128.0 / 15.0


def recorded_amax_traces(export_dir: Path) -> dict[str, list[float]]:
    """Per-call amax traces from a run's final scaler state. The scalers keep their last history_len amaxes
    (newest last); a trace is kept only when it is complete, i.e. the scaler was called no more often than its
    history holds.

    Args:
        export_dir: the run's export folder (verified against its manifest).

    Returns:
        ``"<layer>.<role>"`` -> trace; empty when the export has no scaler file."""

    path = Path(export_dir) / "hif8qat_scalers.safetensors"
    if not path.exists():
        return {}
    verify_folder_manifest(export_dir, _EXPORT_REDO)
    state = load_file(str(path))
    traces = {}
    for key, history in state.items():
        if not key.endswith(".history"):
            continue
        prefix = key[: -len(".history")]
        total = int(state[prefix + ".total"])
        if 0 < total <= history.numel():
            traces[prefix] = history[-total:].double().tolist()
    return traces


def replay_exceedance(traces: Mapping[str, Sequence[float]],
                      estimators: Mapping[str, Mapping[str, Any]] = REPLAY_ESTIMATORS) -> pd.DataFrame:
    """How often, and by how much, each estimator's delayed estimate is exceeded on the same traces.

    Every trace is replayed call by call through ``scaling.replay.replay_rows`` (interval 1; the traces of one role and
    length in one bank); ratio = amax / estimate, where estimate = target / scale is what the scale was computed
    from before the call's own amax was known.

    Args:
        traces: ``"<layer>.<role>"`` -> per-call amax trace.
        estimators: name -> scaling overrides.

    Returns:
        One row per (estimator, role): share of calls exceeded, median and high ratios, share beyond the 2-bit-mantissa
        tier, headroom lost."""


    rows = []
    for name, overrides in estimators.items():
        cfg = ScalingConfig.from_dict({**overrides, "interval": 1})
        for role in ("A", "W", "G"):
            ratios = []
            target = cfg.targets()[role]
            by_len: dict[int, list[Sequence[float]]] = {}
            for key, trace in traces.items():
                if key.endswith("." + role) and trace:
                    by_len.setdefault(len(trace), []).append(trace)
            for same in by_len.values():
                amax = torch.tensor(same, dtype=torch.float64)
                scales = replay_rows(amax.float(), cfg, role=role).double()
                ratios += list((amax * scales / target).numpy())  # = amax / estimate, one array per trace
            if not ratios:
                continue
            r = np.concatenate(ratios)
            exceeded = r > 1 + 1e-6
            rows.append({"estimator": name, "role": role, "traces": len(ratios), "calls": int(r.size),
                         "frac_exceeded": float(exceeded.mean()),
                         "median_ratio_when_exceeded": (float(np.median(r[exceeded])) if exceeded.any()
                                                        else float("nan")),
                         "p99_ratio": float(np.quantile(r, 0.99)), "max_ratio": float(r.max()),
                         "frac_beyond_2bit_tier": float((r > _TWO_BIT_TIER_RATIO).mean()),
                         "mean_headroom_lost_bits": float(np.log2(np.maximum(r, 1.0)).mean())})
    return pd.DataFrame(rows)


def replay_table(runs: list[RunInfo], used: FilesUsed) -> pd.DataFrame:
    """Every run's recorded traces replayed (complete traces only; see recorded_amax_traces), one block per run.

    Args:
        runs: the runs read.
        used: collects the files read.

    Returns:
        The table; empty when no run has traces."""
    replay_frames = []
    for r in runs:
        traces = recorded_amax_traces(r.path / "export")
        if traces:
            df = replay_exceedance(traces)
            df.insert(0, "trace_source", f"{r.experiment}/seed{r.seed}")
            replay_frames.append(df)
            used.add(r, r.path / "export" / "hif8qat_scalers.safetensors")
    return pd.concat(replay_frames, ignore_index=True) if replay_frames else pd.DataFrame()
