"""Delayed and just-in-time scaling in every element format, on the test reference and on a one-row bank.

FP8 rows quantize with the saturating FP8 cast of their role's format and its target (TE's convention);
``algo=current`` scales each call from its own amax (alone, or as a phase of a schedule) while the history
keeps recording; telemetry counts the values each format clips. Exports and evaluations carry the format."""

import json
import math

import pytest
import torch
from test_bank import tiny_llama
from test_scaling import assert_no_host_sync

from hif8qat.evaluate.loading import quant_eval_meta
from hif8qat.formats.qdq import (
    FORMATS,
    clipped_count,
    fp8_qdq_scaled,
    hif8_qdq_scaled,
    qdq_scaled_amax,
)
from hif8qat.models.quant_files import QUANT_JSON, load_quant_export, save_quant_export
from hif8qat.quant.linear import (
    _convert_model,
    freeze_scales,
    quant_linears,
    set_step,
    step_telemetry,
)
from hif8qat.scaling.bank_row import BankedScaler
from hif8qat.scaling.settings import ScalingConfig

ONE_THREAD = True  # conftest._one_thread


def jit(amax: float, target: float) -> float:
    """The float32 just-in-time scale of an amax, by the contract: target / (amax + 1e-12) in float64, with
    amax 1 for a NaN, infinite or non-positive amax."""
    a = amax if 0 < amax < math.inf else 1.0
    return torch.tensor(target / (a + 1e-12), dtype=torch.float64).to(torch.float32).item()


def qdq(x, scale, fmt):
    return qdq_scaled_amax(x, torch.tensor(scale), fmt)[0]


# ------------------------------------------------------------------------------------------------ FP8 rows
@pytest.mark.parametrize("setting,role,fmt,target", [
    ("hybrid", "A", "e4m3", 448.0), ("hybrid", "W", "e4m3", 448.0), ("hybrid", "G", "e5m2", 57344.0),
    ("e5m2", "A", "e5m2", 57344.0), ("e4m3", "G", "e4m3", 448.0),
])
def test_fp8_rows_quantize_in_their_roles_format_with_its_target(setting, role, fmt, target, impl):
    sc = impl.Scaler(role, ScalingConfig(format=setting, algo="max", history_len=4))
    assert sc.fmt == fmt and sc.target == target
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(300, generator=g) * 2
    x2 = torch.randn(300, generator=g) * 9  # outgrows the estimate: E4M3 clips, E5M2 (x57344 / 9) clips too
    y1 = sc.quantize(x1)
    a1 = x1.abs().max().item()
    assert torch.equal(y1, fp8_qdq_scaled(x1, jit(a1, target), fmt))  # cold start: own amax -> format max
    y2 = sc.quantize(x2)
    assert sc.scale.item() == jit(a1, target)  # delayed: the history's max, i.e. the first amax
    assert torch.equal(y2, fp8_qdq_scaled(x2, jit(a1, target), fmt))
    assert y2.abs().max().item() == pytest.approx(FORMATS[fmt].max / jit(a1, target), rel=1e-6)  # saturated


def test_margin_lowers_the_fp8_target_by_powers_of_two(impl):
    sc = impl.Scaler("A", ScalingConfig(format="e4m3", margin=3))
    x = torch.randn(100) * 5
    sc.quantize(x)
    assert sc.scale.item() == jit(x.abs().max().item(), 448.0 / 8)


# ------------------------------------------------------------------------------------------------ current
@pytest.mark.parametrize("setting,role,fmt,target", [("hif8", "A", "hif8", 15.0), ("hybrid", "W", "e4m3", 448.0),
                                                     ("hybrid", "G", "e5m2", 57344.0)])
def test_current_scales_every_call_from_its_own_amax_and_keeps_the_history(setting, role, fmt, target, impl):
    sc = impl.Scaler(role, ScalingConfig(format=setting, algo="current", history_len=8))
    g = torch.Generator().manual_seed(1)
    amaxes = []
    for i, mag in enumerate([1.0, 300.0, 1e-3, 7.0, 7.0, 0.02]):
        x = torch.randn(257, generator=g) * mag
        y = sc.quantize(x)
        a = x.abs().max().item()
        amaxes.append(a)
        assert sc.scale.item() == jit(a, target), i
        assert torch.equal(y, qdq(x, jit(a, target), fmt)), i
    assert sc.history_values() == amaxes
    rec = sc.telemetry_record()
    assert rec["amax_ratio_max"] == 1.0 and rec["amax_ratio_gt1"] == 0  # never exceeded: the oracle
    # a non-finite tensor falls back to scale = target and stays out of the history, as a cold start does
    bad = torch.tensor([1.0, math.nan, 2.0])
    sc.quantize(bad)
    assert sc.scale.item() == target and sc.history_values() == amaxes


def test_current_inside_a_schedule_switches_in_and_back_out(impl):
    """{0: max, 3: current, 6: most_recent}: the delayed phases read the amaxes recorded under current."""
    cfg = ScalingConfig(algo={0: "max", 3: "current", 6: "most_recent"}, history_len=4)
    amaxes = [2.0, 1.0, 4.0, 8.0, 0.5, 3.0, 5.0, 6.0, 1.5]
    got = impl.replay(amaxes, cfg, steps=list(range(len(amaxes)))).tolist()
    want = [jit(e, 15.0) for e in (2.0, 2.0, 2.0,  # cold start, then max of [2], [2, 1]
                                   8.0, 0.5, 3.0,  # current: own amax
                                   3.0, 5.0, 6.0)]  # most_recent: the previous call's amax
    assert got == want


def test_current_with_an_interval_and_step_history(impl):
    cfg = ScalingConfig(algo={0: "current", 2: "mean"}, history_len=3, interval=3, history_unit="step")
    steps = [0, 0, 1, 1, 2, 2, 3]
    amaxes = [1.0, 3.0, 2.0, 6.0, 5.0, 5.0, 9.0]
    got = impl.replay(amaxes, cfg, steps=steps).tolist()
    # current ignores the interval and the step unit; the step history gets max(1, 3) and max(2, 6); mean
    # from step 2 over those two entries, refreshed every 3 steps (step 3 reuses the block)
    want = [jit(a, 15.0) for a in (1.0, 3.0, 2.0, 6.0, 4.5, 4.5, 4.5)]
    assert got == want


def test_frozen_current_keeps_scaling_from_own_amax_and_records_nothing(impl):
    sc = impl.Scaler("A", ScalingConfig(format="hybrid", algo="current"))
    sc.quantize(torch.randn(50))
    before = sc.history_values()
    sc.freeze(True)
    x = torch.randn(40) * 123
    assert torch.equal(sc.quantize(x), fp8_qdq_scaled(x, jit(x.abs().max().item(), 448.0), "e4m3"))
    assert sc.history_values() == before


@pytest.mark.parametrize("cfg", [ScalingConfig(format="hybrid", algo="max", history_len=4),
                                 ScalingConfig(algo={0: "max", 2: "current"}, history_len=4),
                                 ScalingConfig(format="e4m3", algo="current", history_unit="step")],
                         ids=["hybrid", "current_phase", "fp8_current_step"])
def test_no_host_sync_per_call(cfg):
    assert_no_host_sync(BankedScaler.standalone("A", cfg), steps=5)


def test_state_round_trip_under_current(impl):
    cfg = ScalingConfig(algo={0: "current", 3: "max"}, history_len=4)
    a, b = impl.Scaler("A", cfg), impl.Scaler("A", cfg)
    for step in range(2):
        a.set_step(step)
        a.observe_amax(float(step + 2))
    b.load_state_dict(a.state_dict())
    for sc in (a, b):
        sc.set_step(3)
    assert a.observe_amax(1.0).item() == b.observe_amax(1.0).item() == jit(3.0, 15.0)


# ------------------------------------------------------------------------------------------------ telemetry
@pytest.mark.parametrize("setting,fmt,target", [("hif8", "hif8", 15.0), ("hybrid", "e4m3", 448.0)])
def test_clipped_count_and_exceed_fraction_follow_the_format(setting, fmt, target, impl):
    sc = impl.Scaler("A", ScalingConfig(format=setting, algo="most_recent", telemetry_stats_every=1))
    g = torch.Generator().manual_seed(2)
    sc.quantize(torch.randn(4000, generator=g))
    x = torch.randn(4000, generator=g) * 4
    x[:5] = torch.tensor([3e5, -5e4, 400.0, 2e3, -2e4])  # far beyond the estimate
    scale = sc.scale.clone()
    sc.quantize(x)
    rec = sc.telemetry_record()
    ax = (x.double() * scale.double()).abs()
    assert rec["clipped_count"] == clipped_count(x, scale, fmt).item()
    assert rec["exceed_frac_max"] == pytest.approx(float((ax > target).double().mean()), rel=1e-6)
    if fmt == "hif8":  # only the outliers past 40960 / 15 = 2731x the estimate overflow
        assert rec["clipped_count"] == int((ax >= 40960).sum()) == 3
    else:  # E4M3 clips everything above the estimate
        assert rec["clipped_count"] == int((ax > 448).sum()) > 5
        y = fp8_qdq_scaled(x, scale, "e4m3")
        assert int((y.abs() == 448 / scale).sum()) >= rec["clipped_count"]


def test_step_telemetry_aggregates_clipped_counts_per_role():
    m = tiny_llama()
    _convert_model(m, "mlp", None, ScalingConfig(format="hybrid", algo="most_recent", telemetry_stats_every=1))
    ids = torch.randint(0, 96, (2, 8))
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        set_step(m, step)
        ids = torch.randint(0, 96, (2, 8), generator=gen)
        m(ids, labels=ids).loss.backward()
    rows = {role: [sc.telemetry_record()["clipped_count"] for _, layer in quant_linears(m)
                   for r, sc in layer.scalers() if r == role] for role in "AWG"}
    tel = step_telemetry(m)
    assert "tel/A/overflow_count" not in tel
    for role in "AWG":
        assert tel[f"tel/{role}/clipped_count"] == sum(rows[role])
        assert tel[f"tel/{role}/stats_calls"] == tel[f"tel/{role}/calls"] == 3 * len(rows[role])
    assert sum(rows["A"]) + sum(rows["G"]) > 0  # E4M3/E5M2 at the format max: a grown tensor clips


# ------------------------------------------------------------------------------------------------ exports
def _trained(cfg: ScalingConfig):
    m = tiny_llama()
    _convert_model(m, "mlp", None, cfg)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    for step in range(2):
        set_step(m, step)
        m(ids, labels=ids).loss.backward()
    return m


def test_fp8_export_evaluates_in_fp8_with_frozen_scales(tmp_path):
    m = _trained(ScalingConfig(format="hybrid", algo="max", history_len=4))
    save_quant_export(m, tmp_path)
    doc = json.loads((tmp_path / QUANT_JSON).read_text())
    assert doc["config"]["format"] == "hybrid" and doc["element_formats"] == {"A": "e4m3", "W": "e4m3", "G": "e5m2"}
    plain = tiny_llama()
    load_quant_export(plain, tmp_path)
    freeze_scales(plain, True)
    name, layer = next(iter(quant_linears(plain)))
    assert layer.bank.formats[:3] == ["e4m3", "e4m3", "e5m2"]
    x = torch.randn(3, layer.in_features) * 50
    sa, sw = layer.scaler_a.scale, layer.scaler_w.scale
    want = torch.nn.functional.linear(fp8_qdq_scaled(x, sa, "e4m3"), fp8_qdq_scaled(layer.weight, sw, "e4m3"),
                                      layer.bias)
    with torch.no_grad():
        assert torch.equal(layer(x), want)
    meta = quant_eval_meta(plain, tmp_path)
    assert meta["format"] == "hybrid" and meta["element_formats"]["G"] == "e5m2"
    assert meta["scales"].startswith("frozen")


def test_current_export_evaluates_with_just_in_time_scales(tmp_path):
    m = _trained(ScalingConfig(algo="current"))
    save_quant_export(m, tmp_path)
    plain = tiny_llama()
    load_quant_export(plain, tmp_path)
    freeze_scales(plain, True)
    _, layer = next(iter(quant_linears(plain)))
    x = torch.randn(3, layer.in_features) * 1e-3  # far from any training amax
    w = layer.weight.detach()
    want = torch.nn.functional.linear(hif8_qdq_scaled(x, jit(x.abs().max().item(), 15.0)),
                                      hif8_qdq_scaled(w, jit(w.abs().max().item(), 15.0)), layer.bias)
    with torch.no_grad():
        assert torch.equal(layer(x), want)
    assert quant_eval_meta(plain, tmp_path)["scales"].startswith("just-in-time")


def test_export_written_before_fp8_loads_as_hif8(tmp_path):
    m = _trained(ScalingConfig(algo="max", history_len=4))
    save_quant_export(m, tmp_path)
    doc = json.loads((tmp_path / QUANT_JSON).read_text())
    for k in ("format", "margin"):
        doc["config"].pop(k)
    doc.pop("element_formats")
    (tmp_path / QUANT_JSON).write_text(json.dumps(doc))
    plain = tiny_llama()
    load_quant_export(plain, tmp_path)
    _, layer = next(iter(quant_linears(plain)))
    assert set(layer.bank.formats) == {"hif8"} and layer.scaler_a.target == 15.0
    meta = quant_eval_meta(plain, tmp_path)
    assert meta["format"] == "hif8" and meta["element_formats"] == {"A": "hif8", "W": "hif8", "G": "hif8"}
