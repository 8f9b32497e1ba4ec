"""The estimator comparison on recorded traces (report.replay_exceedance / recorded_amax_traces)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hif8qat.artefacts import write_folder_manifest
from hif8qat.report import recorded_amax_traces, replay_exceedance


def test_growing_trace_exceeds_most_recent_every_call_but_max_only_when_it_grows():
    # amax doubles every call: each delayed estimate (the previous amax) is exceeded by exactly 2x.
    growing = {"l.A": [2.0 ** i for i in range(10)]}
    table = replay_exceedance(growing, {"most_recent(30)": {"algo": "most_recent", "history_len": 30},
                                        "max(64)": {"algo": "max", "history_len": 64}}).set_index("estimator")
    # The first call is a cold start (its own amax), the other 9 are exceeded 2x.
    assert table.loc["most_recent(30)", "frac_exceeded"] == pytest.approx(0.9)
    assert table.loc["most_recent(30)", "max_ratio"] == pytest.approx(2.0, rel=1e-6)
    assert table.loc["max(64)", "frac_exceeded"] == pytest.approx(0.9)


def test_spike_is_absorbed_by_max_window_but_not_by_most_recent():
    trace = {"l.A": [1.0, 1.0, 8.0, 1.0, 9.0, 1.0, 8.6]}
    t = replay_exceedance(trace, {"mr": {"algo": "most_recent", "history_len": 30},
                                  "max": {"algo": "max", "history_len": 64}}).set_index("estimator")
    # most_recent: the spikes at 2, 4, 6 each exceed the previous call's amax of 1 by 8x or more.
    assert t.loc["mr", "frac_exceeded"] == pytest.approx(3 / 7)
    assert t.loc["mr", "max_ratio"] == pytest.approx(9.0, rel=1e-6)
    assert t.loc["mr", "frac_beyond_2bit_tier"] == pytest.approx(2 / 7)  # 9.0 and 8.6 > 128/15 = 8.53
    # max over the window: only the first spike and the new maximum 9 exceed it.
    assert t.loc["max", "frac_exceeded"] == pytest.approx(2 / 7)
    assert t.loc["max", "max_ratio"] == pytest.approx(8.0, rel=1e-6)


def test_recorded_traces_keep_only_complete_histories_in_call_order(tmp_path):
    state = {
        "a.A.history": torch.tensor([0.0, 0.0, 1.0, 2.0, 3.0]), "a.A.total": torch.tensor(3),
        "b.W.history": torch.tensor([4.0, 5.0, 6.0]), "b.W.total": torch.tensor(7),  # wrapped: incomplete
        "c.G.history": torch.zeros(4), "c.G.total": torch.tensor(0),  # never called
    }
    save_file(state, str(tmp_path / "hif8qat_scalers.safetensors"))
    write_folder_manifest(tmp_path)  # as an export records its files
    assert recorded_amax_traces(tmp_path) == {"a.A": [1.0, 2.0, 3.0]}
    assert recorded_amax_traces(tmp_path / "missing") == {}
