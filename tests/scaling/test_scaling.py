"""Delayed tensor scaling: hand-worked estimator / interval / schedule / cold-start / reset / non-finite cases,
exact resume, telemetry, and no host sync for the tensor estimators.

Every behavioural test runs twice: on the test reference (tests/reference_scaling.py) and on a one-row scaler
bank, the implementation (``impl`` fixture); both must give the same, hand-worked, scales and histories bit
for bit. Host-sync freedom is the bank's alone."""

import copy
import math
import random
import warnings

import pytest
import torch

from hif8qat.scaling.bank import ScalerBank
from hif8qat.scaling.bank_row import BankedScaler
from hif8qat.scaling.forecast import ExpSmoothForecaster, ExpSmoothParams
from hif8qat.scaling.replay import replay, replay_rows
from hif8qat.scaling.settings import STATE_KEYS, ScalingConfig, lookup

NAN, INF = float("nan"), float("inf")


ONE_THREAD = True  # conftest._one_thread


def s(*amaxes, target=15.0):
    """Expected float32 scales for the given estimates."""
    return torch.tensor([target / (a + 1e-12) for a in amaxes], dtype=torch.float64).to(torch.float32)


def assert_scales(got, *estimates, target=15.0):
    torch.testing.assert_close(got, s(*estimates, target=target), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "kw, field",
    [
        ({"history_len": 0}, "history_len"),
        ({"history_len": -3}, "history_len"),
        ({"history_len": 2.5}, "history_len"),
        ({"algo": "median"}, "algo"),
        ({"algo": {1: "max"}}, "algo"),
        ({"algo": {0: "max", -5: "mean"}}, "algo"),
        ({"algo": {0: "max", 10: "bogus"}}, "algo"),
        ({"interval": 0}, "interval"),
        ({"interval": {0: 1, 100: 0}}, "interval"),
        ({"interval": {5: 2}}, "interval"),
        ({"target_fwd": 0.0}, "target_fwd"),
        ({"target_bwd": -1.0}, "target_bwd"),
        ({"target_fwd": float("inf")}, "target_fwd"),
        ({"history_unit": "microbatch"}, "history_unit"),
        ({"amax_reduce": "sum"}, "amax_reduce"),
        ({"grad_rounding": "hr"}, "grad_rounding"),
        ({"telemetry_dump_every": -1}, "telemetry_dump_every"),
    ],
)
def test_config_validation_names_field_and_allowed(kw, field):
    with pytest.raises(ValueError, match=rf"ScalingConfig\.{field}=.*allowed"):
        ScalingConfig(**kw).validate()


def test_config_dict_round_trip_and_string_schedule_keys():
    cfg = ScalingConfig.from_dict({"algo": {"0": "most_recent", "1000": "exp_smooth"}, "history_len": 30,
                                   "interval": {"0": 1, "1000": 10}})
    assert cfg.algo == {0: "most_recent", 1000: "exp_smooth"}
    intervals, algos = cfg.interval_schedule(), cfg.algo_schedule()
    assert lookup(intervals, 999) == 1 and lookup(intervals, 1000) == 10 and lookup(algos, 5000) == "exp_smooth"
    assert ScalingConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown field"):
        ScalingConfig.from_dict({"algorithm": "max"})


# ------------------------------------------------------------------------------------------------ estimators
def test_max_window_hand_worked(impl):
    cfg = ScalingConfig(algo="max", history_len=3)
    # call:        0  1  2  3  4  5    history before call (last 3)
    amax = [2, 1, 8, 4, 3, 0.5]
    # scale from:  cold(2) [2] [2,1] [2,1,8] [1,8,4] [8,4,3]
    assert_scales(impl.replay(amax, cfg), 2, 2, 2, 8, 8, 8)
    assert_scales(impl.replay(amax + [1, 1], cfg)[6:], 4, 3)  # window slides: [4,3,.5] then [3,.5,1]


def test_most_recent_and_mean_hand_worked(impl):
    amax = [2, 1, 8, 4]
    assert_scales(impl.replay(amax, ScalingConfig(algo="most_recent")), 2, 2, 1, 8)
    assert_scales(impl.replay(amax + [6], ScalingConfig(algo="mean", history_len=3)), 2, 2, 1.5, 11 / 3, 13 / 3)


def test_interval_refreshes_every_k_calls_history_grows_every_call(impl):
    cfg = ScalingConfig(algo="most_recent", interval=3)
    amax = [1, 2, 3, 4, 5, 6, 7, 8]
    # block 0 (cold start, amax 1): calls 0-2; refresh at 3 from history[-1]=3; at 6 from 6
    assert_scales(impl.replay(amax, cfg), 1, 1, 1, 3, 3, 3, 6, 6)
    cfg = ScalingConfig(algo="max", interval=2, history_len=2)
    # refresh at 2 from [1,5] -> 5; at 4 from [2,1] -> 2 (5 fell out of the window while the block ran)
    assert_scales(impl.replay([1, 5, 2, 1, 9, 9], cfg), 1, 1, 5, 5, 2, 2)


def test_schedule_switch_algo_and_interval(impl):
    cfg = ScalingConfig(algo={0: "most_recent", 2: "max"}, interval={0: 1, 3: 2}, history_len=8)
    amax = [4, 1, 2, 8, 1, 1, 1]
    steps = [0, 0, 1, 2, 3, 3, 4]
    # call 0 cold 4; call1 mr [4]->4; call2 mr ->1; call3 step2 algo switch to max: max[4,1,2]=4;
    # call4 step3 interval switch -> refresh: max(...,8)=8; call5 in block -> 8; call6 refresh max -> 8
    assert_scales(impl.replay(amax, cfg, steps=steps), 4, 4, 1, 4, 8, 8, 8)


def test_schedule_lookup_uses_largest_key_not_above_step():
    cfg = ScalingConfig(algo={0: "max", 10: "most_recent", 20: "mean"})
    assert [lookup(cfg.algo_schedule(), t) for t in (0, 9, 10, 19, 20, 10**6)] == [
        "max", "max", "most_recent", "most_recent", "mean", "mean"]


def _authors_rules(seq, algo, L, k):
    """Independent restatement of the authors' delayed-scaling rules (finite positive amaxes)."""
    est = {"max": max, "most_recent": lambda h: h[-1], "mean": lambda h: sum(h) / len(h)}[algo]
    hist, out, cur, j = [], [], None, 0
    for i, a in enumerate(seq):
        if i == 0:
            hist.append(a)
            cur, j = est(hist), 0
        else:
            j += 1
            if j % k == 0:
                cur, j = est(hist), 0
            hist = (hist + [a])[-L:]
        out.append(15.0 / (cur + 1e-12))
    return torch.tensor(out, dtype=torch.float64).to(torch.float32)


@pytest.mark.parametrize("algo", ["max", "most_recent", "mean"])
@pytest.mark.parametrize("L,k", [(1, 1), (5, 1), (7, 3), (64, 10)])
def test_matches_authors_rules_on_random_traces(algo, L, k, impl):
    rng = random.Random(L * 100 + k)
    # amaxes are float32 values (max|x| of a float32 or bf16 tensor), as in the authors' float(amax.item())
    seq = torch.tensor([math.exp(rng.gauss(0, 2)) for _ in range(150)], dtype=torch.float32).tolist()
    got = impl.replay(seq, ScalingConfig(algo=algo, history_len=L, interval=k))
    torch.testing.assert_close(got, _authors_rules(seq, algo, L, k), rtol=0, atol=0)


# ---------------------------------------------------------------------------------- cold start, reset, non-finite
def test_cold_start_uses_own_amax_and_reset_restarts_it(impl):
    sc = impl.Scaler("A", ScalingConfig(algo="max", history_len=4))
    assert sc.observe_amax(3.0).item() == s(3).item()
    assert sc.observe_amax(6.0).item() == s(3).item()
    assert sc.observe_amax(1.0).item() == s(6).item()
    sc.reset()
    assert not sc.initialized and sc.history_values() == []
    assert sc.observe_amax(0.5).item() == s(0.5).item()  # cold again, old max 6 forgotten
    assert sc.observe_amax(0.25).item() == s(0.5).item()
    assert sc.history_values() == [0.5, 0.25]


def test_non_finite_amax_never_enters_history(impl):
    cfg = ScalingConfig(algo="max", history_len=3)
    got = impl.replay([2, NAN, INF, 1, 1, 1, 1], cfg)
    # history stays [2] through the NaN/inf calls, then [2,1], [2,1,1], [1,1,1]
    assert_scales(got, 2, 2, 2, 2, 2, 2, 1)
    sc = impl.Scaler("A", cfg)
    for a in [2, NAN, INF, 1]:
        sc.observe_amax(a)
    assert sc.history_values() == [2.0, 1.0]
    assert sc.telemetry_record()["nonfinite_count"] == 2


def test_non_finite_cold_start_falls_back_to_target_then_recovers(impl):
    cfg = ScalingConfig(algo="most_recent")
    # cold NaN -> estimate 1.0 (authors' fallback) -> scale = target; empty history keeps it; then 4
    assert_scales(impl.replay([NAN, NAN, 4, 2], cfg), 1, 1, 1, 4)
    # a cold +inf amax (an overflowed tensor) falls back the same way: never a zero scale
    assert_scales(impl.replay([INF, INF, 4, 2], cfg), 1, 1, 1, 4)
    # an all-zero tensor: estimate 0 -> fallback 1.0, later zeros keep the previous estimate
    assert_scales(impl.replay([0, 0, 8, 0, 3], cfg), 1, 1, 1, 8, 8)


def test_mean_with_interval_schedule_non_finite_cold_start_and_zeros_hand_worked(impl):
    cfg = ScalingConfig(algo="mean", history_len=3, interval={0: 1, 4: 3})
    amax = [NAN, 0, 6, 3, 9, 12, 1, 2, 4]
    # call (step = call)  history before the call  estimate
    # 0  cold start, own amax NaN -> fallback       1
    # 1  []         mean 0 -> keep the previous      1
    # 2  [0]        mean 0 -> keep the previous      1
    # 3  [0, 6]     (0 + 6) / 2                      3
    # 4  [0, 6, 3]  step 4: interval 3, a new block: (0 + 6 + 3) / 3 = 3
    # 5, 6          inside the block                 3
    # 7  [9, 12, 1] the block is used up: 22 / 3 (the window slid on while the block ran)
    # 8  inside the new block                        22 / 3
    got = impl.replay(amax, cfg, steps=list(range(len(amax))))
    assert_scales(got, 1, 1, 1, 3, 3, 3, 3, 22 / 3, 22 / 3)


def test_max_per_step_with_interval_hand_worked(impl):
    cfg = ScalingConfig(algo="max", history_len=2, history_unit="step", interval=2)
    amax = [4, NAN, 2, 8, 1, 3, 5, 7]
    steps = [0, 0, 1, 1, 2, 3, 4, 4]
    # step 0: cold start from 4 (a block of 2 steps opens); the NaN is left out of the step's maximum (4)
    # step 1: entry 4 committed, history [4]; 2nd step of the block: still 4; the step's maximum is 8
    # step 2: history [4, 8]; a new block: max 8; step 3: history [8, 1], block continues: 8
    # step 4: history [1, 3] (8 slid out); a new block: max 3, for both calls of the step
    assert_scales(impl.replay(amax, cfg, steps=steps), 4, 4, 4, 4, 8, 8, 3, 3)


def test_history_unit_step_one_entry_per_step(impl):
    cfg = ScalingConfig(algo="max", history_len=2, history_unit="step")
    amax = [1, 3, 2, 5, 4, 1, 1]
    steps = [0, 0, 1, 1, 2, 3, 4]
    # step 0: cold (1) for the whole step; step-0 entry = max(1,3)=3; step 1 uses [3]; entry 5;
    # step 2 uses [3,5] -> 5; entry 4; step 3 uses [5,4] -> 5; step 4 uses [4,1] -> 4
    assert_scales(impl.replay(amax, cfg, steps=steps), 1, 1, 3, 3, 5, 5, 4)


# ------------------------------------------------------------------------------------------------ state dict
def _trace(n, seed=0):
    rng = random.Random(seed)
    out = [math.exp(rng.gauss(0.01 * i, 0.3)) for i in range(n)]
    out[n // 3] = NAN
    return out


@pytest.mark.parametrize(
    "cfg, split",
    [
        (ScalingConfig(algo="max", history_len=8, interval=3), 13),  # 13 = mid-interval
        (ScalingConfig(algo="mean", history_len=5, interval={0: 1, 5: 4}), 22),
        (ScalingConfig(algo={0: "most_recent", 4: "exp_smooth"}, history_len=30, interval={0: 1, 4: 5}), 67),
        (ScalingConfig(algo="max", history_len=4, history_unit="step", interval=2), 17),
    ],
)
def test_state_dict_round_trip_mid_interval_continues_identically(cfg, split, impl):
    amax = _trace(110)
    steps = [i // 3 for i in range(len(amax))]
    ref = impl.replay(amax, cfg, steps=steps, role="G")
    a = impl.Scaler("G", cfg)
    got = []
    for i in range(split):
        a.set_step(steps[i])
        got.append(a.observe_amax(amax[i]))
    state = a.state_dict()
    b = impl.Scaler("G", cfg)
    b.load_state_dict({k: v.clone() for k, v in state.items()})
    del a
    for i in range(split, len(amax)):
        b.set_step(steps[i])
        got.append(b.observe_amax(amax[i]))
    torch.testing.assert_close(torch.stack(got), ref, rtol=0, atol=0)


def test_scaler_tables_are_not_in_enclosing_state_dict():
    m = torch.nn.Module()
    m.bank = ScalerBank(ScalingConfig(), ["A", "W"])
    assert list(m.state_dict().keys()) == [] and list(m.named_buffers()) == []
    # the per-quantizer format checkpoints and exports have always used
    assert set(m.bank.row_state_dict(1)) == set(STATE_KEYS) == {"history", "total", "pending", "pending_valid",
                                                                "scale_block", "est_block", "meta"}


# ------------------------------------------------------------------------------------------------ exp_smooth
def test_exp_smooth_warmup_is_most_recent_and_constant_series_is_fixed_point(impl):
    cfg = ScalingConfig(algo="exp_smooth", history_len=30)
    amax = [float(v) for v in [3, 5, 2, 7]]
    assert_scales(impl.replay(amax, cfg), 3, 3, 5, 2)
    got = impl.replay([2.0] * 60, cfg)
    assert_scales(got[-1:], 2.0)


def f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float64).to(torch.float32).item()


def test_exp_smooth_blocks_and_median_clipping_hand_worked(impl):
    """Warm-up (fewer than 20 amaxes seen: the forecast is the window's most recent amax), interval blocks, and
    the scale clipped to [0.01, 100] x s_med, s_med = 15 / median(window) (upper bound also <= 1e8)."""
    cfg = ScalingConfig(algo="exp_smooth", history_len=4, interval={0: 1, 5: 3})
    amax = [2, 4, 1000, 1, NAN, 3, 5, 0, 6, 1]
    # call  window (history before the call)  forecast  median  scale
    # 0     cold start, own amax                 -         -      15/2 = 7.5
    # 1     [2]                                  2         2      7.5
    # 2     [2, 4]                               4         3      15/4 = 3.75 (bounds [0.05, 500])
    # 3     [2, 4, 1000]                         1000      4      15/1000 = 0.015 < 0.01 * 15/4: 0.0375
    # 4     [2, 4, 1000, 1]                      1         3      15
    # 5     step 5, interval 3: a block of 3; the NaN never entered the window [2, 4, 1000, 1]:
    #       forecasts [1, 1, 1] -> 15 for calls 5, 6 and 7
    # 8     [1, 3, 5, 0] (3, 5, 0 appended): forecast 0, not positive -> the median (1 + 3) / 2 = 2: 7.5
    # 9     inside that block                                     7.5
    got = impl.replay(amax, cfg, steps=list(range(len(amax))))
    want = [s(2).item(), s(2).item(), s(4).item(), f32(0.01 * (15 / (4 + 1e-12))), *[s(1).item()] * 4,
            s(2).item(), s(2).item()]
    assert got.tolist() == want


def test_exp_smooth_upper_clips_and_the_1e8_cap_hand_worked(impl):
    cfg = ScalingConfig(algo="exp_smooth", history_len=4)
    tiny, t30 = 2.0**-10, 2.0**-30
    amax = [100, 100, 100, tiny, 5, t30, t30, t30, 1]
    # call  window                      forecast  scale 15/forecast  median, upper bound 100 * 15/median
    # 0-3   cold start, then [100..]    100       0.15
    # 4     [100, 100, 100, 2^-10]      2^-10     15360              100: bound 15 -> 15
    # 5     [100, 100, 2^-10, 5]        5         3                  (5 + 100)/2: bound 28.6 -> 3
    # 6     [100, 2^-10, 5, 2^-30]      2^-30     1.6e10             (2^-10 + 5)/2: bound 599.9
    # 7     [2^-10, 5, 2^-30, 2^-30]    2^-30     1.6e10             (2^-30 + 2^-10)/2: bound 3.07e6
    # 8     [5, 2^-30, 2^-30, 2^-30]    2^-30     1.6e10             2^-30: 100 * 1.6e10 > 1e8 -> 1e8
    got = impl.replay(amax, cfg)

    def upper(med):
        return f32(100 * (15 / (med + 1e-12)))

    want = [s(100).item()] * 4 + [upper(100), s(5).item(), upper((tiny + 5) / 2), upper((t30 + tiny) / 2), 1e8]
    assert got.tolist()[:9] == want


@pytest.mark.parametrize("role", ["A", "G"])
def test_exp_smooth_lone_spike_after_a_flat_series_is_clipped_to_the_median(role, impl):
    """Past the warm-up: 22 amaxes of 1 (log 0), a spike of 1024, then 1s. The call after the spike has 23 log
    amaxes z = [0] * 22 + [ln 1024]: the first forecast with >= 3 cross-validation origins (t = 20, 21, 22, each
    forecasting z[t] from z[:t]). Every candidate forecasts 0 from an all-zero prefix, so each has the errors
    (0, 0, ln 1024): equal scores ln(1024) / 3 and equal weights. Whatever their combination, the robust clip
    keeps it within median(z) +- clip_sigma * 1.4826 * MAD(z) = 0 +- 0: the forecast is exp(0) = 1, scale 15,
    where most_recent would use 15 / 1024."""
    cfg = ScalingConfig(algo="exp_smooth", history_len=4)
    amax = [1.0] * 22 + [1024.0, 1.0, 1.0]
    sc = impl.Scaler(role, cfg)
    got = [sc.observe_amax(a).item() for a in amax[:24]]
    assert got == [s(1).item()] * 24
    assert sc._forecaster.scores == pytest.approx(dict.fromkeys(
        ("most_recent", "damped_holt", "trend_following", "ar1"), math.log(1024) / 3), rel=1e-12)
    assert sc.observe_amax(1.0).item() == s(1).item()  # cross validation is not rerun (every 5 forecasts)
    assert impl.replay(amax, ScalingConfig(algo="most_recent"))[23].item() == s(1024).item()


def test_a_copied_forecaster_forecasts_as_the_original_and_shares_nothing_it_changes():
    """The bank's rollback snapshot: a copy taken mid-series forecasts what the original does from there on,
    and feeding or forecasting with one leaves the other's observations, scores and counters as they were."""
    f = ExpSmoothForecaster(ExpSmoothParams())
    f.observe([math.exp(math.sin(i / 3)) for i in range(45)])
    f.forecast([1.0, 2.0], 3)  # cross-validation scores and counters set
    g = copy.deepcopy(f)
    before = (list(f.obs), dict(f.scores), f.n_forecasts, f.last_cv_at)
    g.observe([5.0, 7.0])
    for _ in range(6):  # past cv_every: g's scores are recomputed
        g.forecast([1.0, 5.0, 7.0], 2)
    assert (f.obs, f.scores, f.n_forecasts, f.last_cv_at) == before
    h = copy.deepcopy(f)
    f.observe([5.0, 7.0])
    h.observe([5.0, 7.0])
    assert [f.forecast([1.0, 5.0], 4) for _ in range(7)] == [h.forecast([1.0, 5.0], 4) for _ in range(7)]


def test_exp_smooth_forecast_follows_trend_with_bounds():
    f = ExpSmoothForecaster(ExpSmoothParams())
    series = [math.exp(0.05 * i) for i in range(60)]
    f.observe(series)
    pred = f.forecast(series[-30:], 5)
    assert len(pred) == 5 and all(math.isfinite(p) and p > 0 for p in pred)
    last = series[-1]
    assert 0.2 * min(series[-30:]) <= min(pred) and max(pred) <= 3 * max(series[-30:])
    assert pred[0] > series[-10]  # tracks the rising level (not stuck at an old value)
    assert pred[-1] < last * 1.5
    assert set(f.scores) == {"most_recent", "damped_holt", "trend_following", "ar1"}


def test_exp_smooth_counts_new_entries_exactly_with_nan_and_intervals(impl):
    cfg = ScalingConfig(algo="exp_smooth", history_len=30, interval=4)
    sc = impl.Scaler("A", cfg)
    amax = _trace(50, seed=3)
    for a in amax:
        sc.observe_amax(a)
    finite = [a for a in amax if math.isfinite(a)]
    # the forecaster has seen every finite amax up to its last refresh, exactly once each
    n_seen = len(sc._forecaster.obs)
    assert [math.exp(v) for v in sc._forecaster.obs] == pytest.approx(finite[:n_seen], rel=1e-6)
    assert n_seen >= len(finite) - 4


def test_exp_smooth_scale_is_clipped_relative_to_history_median(impl):
    cfg = ScalingConfig(algo="exp_smooth", history_len=5)
    # 60 calls at 1e6 teach the forecaster a level of 1e6; then the amax drops to 1. Once three of the five
    # history entries are 1 the history median is 1, while the forecast (pulled only 10 % toward the median)
    # stays near 1e6, so its scale 15 / ~2.5e5 ~ 6e-5 falls below the floor 0.01 x 15 / median = 0.15
    amax = [1e6] * 60 + [1.0] * 6
    got = impl.replay(amax, cfg)
    assert torch.isfinite(got).all() and (got > 0).all()
    for call in (63, 64):  # history (calls call-5 .. call-1) holds three or four 1s: median 1
        window = amax[call - 5:call]
        median = sorted(window)[2]
        assert median == 1.0
        assert got[call].item() == pytest.approx(0.01 * 15.0 / median, rel=1e-6), call
    assert got[59].item() == pytest.approx(15.0 / 1e6, rel=1e-6)  # steady level: no clip, target / amax


# ------------------------------------------------------------------------------------------------ telemetry
def _spike_run(impl, algo):
    cfg = ScalingConfig(algo=algo, history_len=16, telemetry_stats_every=1)
    sc = impl.Scaler("A", cfg)
    gen = torch.Generator().manual_seed(0)
    ratios, spikes = [], []
    for i in range(12):
        x = torch.randn(64, 32, generator=gen).clamp(-2, 2)
        x[0, 0] = 2.0
        if i % 4 == 2:  # periodic outlier channel: 5000x the usual amax
            x[0, 1] = 1e4
            spikes.append(i)
        sc.quantize(x)
        ratios.append(sc.last["ratio"].item())
    return sc, ratios, spikes


def test_spike_reported_by_most_recent_absorbed_by_max_window(impl):
    sc_mr, r_mr, spikes = _spike_run(impl, "most_recent")
    sc_mx, r_mx, _ = _spike_run(impl, "max")
    assert all(r_mr[i] > 1000 for i in spikes)  # every spike outgrows the most recent estimate
    rec = sc_mr.telemetry_record()
    assert rec["amax_ratio_gt1"] == len(spikes) and rec["clipped_count"] == len(spikes)
    assert rec["amax_ratio_max"] == pytest.approx(5000, rel=1e-6)
    # max over a 16-call window: only the first spike is a surprise; every later call has ratio <= 1
    assert r_mx[spikes[0]] > 1000
    assert all(r <= 1.0 for r in r_mx[spikes[0] + 1:])
    rec = sc_mx.telemetry_record()
    assert rec["amax_ratio_gt1"] == 1 and rec["clipped_count"] == 1
    assert rec["exceed_frac_max"] > 0  # the spike call put the whole tensor above the target tier


def test_statistics_of_an_in_range_call_make_no_pass_over_its_input_and_match_the_reference():
    """On a CPU a statistics call whose largest |x*s| is within the target reads no element of x, and one within
    the format's range makes no pass for the clipped count. Calls in range, beyond the target and beyond the format
    give the reference scaler's telemetry (tests/reference_scaling.py, its own passes on every call)."""
    import reference_scaling
    from torch.utils._python_dispatch import TorchDispatchMode

    from hif8qat.scaling import bank_telemetry

    class FullSizeOps(TorchDispatchMode):
        def __init__(self, numel):
            super().__init__()
            self.numel, self.ops = numel, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() == self.numel:
                self.ops.append(str(func))
            return out

    def passes_over(sc, x, scale):  # the statistics of one call, alone, on a copy of the bank's telemetry
        saved = ([t.clone() for t in (sc.bank.tel_max, sc.bank.tel_cnt, sc.bank.last_stats)],
                 sc.bank.tel_stat_calls.copy())
        amax = x.abs().amax().float()  # what the call's kernel computed
        with FullSizeOps(x.numel()) as seen:
            bank_telemetry.record_stats(sc.bank, x, sc.row, scale, amax)
        (sc.bank.tel_max, sc.bank.tel_cnt, sc.bank.last_stats), sc.bank.tel_stat_calls = saved
        return seen.ops

    cfg = ScalingConfig(algo="max", history_len=4, telemetry_stats_every=1)
    bank, oracle = BankedScaler.standalone("A", cfg), reference_scaling.DelayedScaler("A", cfg)
    gen = torch.Generator().manual_seed(0)
    # 3 outgrows the target (not HiF8's range), 6 the range too
    xs = [torch.randn(64, 32, generator=gen) * {3: 50.0, 6: 1e7}.get(i, 1.0) for i in range(8)]
    kinds = []
    for i, x in enumerate(xs):
        if i:
            scale = bank.scale.clone()
            top = float(x.abs().amax()) * float(scale)
            in_range, clips = top <= bank.target, top >= 40960.0  # HiF8's overflow
            ops = passes_over(bank, x, scale)
            assert (ops == []) == in_range and ("aten.ge.Scalar" in ops) == clips, (i, ops)
            kinds.append((in_range, clips))
        oracle.quantize(x)
        bank.quantize(x)
    got, want = bank.telemetry_record(), oracle.telemetry_record()
    for key in ("exceed_frac_max", "clipped_count", "amax_ratio_gt1", "stats_calls"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    assert got["exceed_frac_max"] > 0 and got["clipped_count"] > 0 and got["stats_calls"] == len(xs)
    assert set(kinds) == {(True, False), (False, False), (False, True)}


def test_stats_cadence_and_reset(impl):
    cfg = ScalingConfig(algo="max", telemetry_stats_every=3)
    sc = impl.Scaler("W", cfg)
    for _ in range(7):
        sc.quantize(torch.randn(16, 16))
    assert sc.telemetry_calls() == (7, 3)  # calls 0, 3, 6
    sc.reset_telemetry()
    assert sc.telemetry_calls() == (0, 0) and sc.tel_cnt.sum().item() == 0
    cfg = ScalingConfig(algo="max", telemetry_dump_every=5)
    sc = impl.Scaler("W", cfg)
    for step in range(7):
        sc.set_step(step)
        sc.quantize(torch.randn(4, 4))
    assert sc.telemetry_calls() == (7, 2)  # steps 0 and 5


# ------------------------------------------------------------------------------------------------ quantize path
def test_quantize_uses_delayed_scale_and_replay_matches(impl):
    from hif8qat.formats.qdq import hif8_qdq_scaled

    cfg = ScalingConfig(algo="max", history_len=4, interval=2)
    sc = impl.Scaler("A", cfg)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 8, generator=gen) * m for m in (1, 3, 0.5, 10, 2, 2)]
    amaxes = [x.abs().max().item() for x in xs]
    expected = impl.replay(amaxes, cfg)
    for x, scale in zip(xs, expected):
        y = sc.quantize(x)
        assert sc.last["scale"].item() == scale.item()
        torch.testing.assert_close(y, hif8_qdq_scaled(x, scale.item()), rtol=0, atol=0)


def test_frozen_uses_last_scale_without_history_update(impl):
    from hif8qat.formats.qdq import hif8_qdq_scaled

    sc = impl.Scaler("A", ScalingConfig(algo="most_recent"))
    sc.quantize(torch.full((4,), 2.0))
    sc.quantize(torch.full((4,), 4.0))
    before = sc.state_dict()
    sc.freeze(True)
    scale = sc.scale.item()
    x = torch.linspace(-100, 100, 9)
    assert torch.equal(sc.quantize(x), hif8_qdq_scaled(x, s(2)))
    assert scale == s(2).item()
    after = sc.state_dict()
    assert torch.equal(before["history"], after["history"]) and torch.equal(before["total"], after["total"])
    fresh = impl.Scaler("A", ScalingConfig())
    fresh.freeze(True)
    x = torch.linspace(-3, 3, 7)
    # never ran: cold scale from this tensor, nothing recorded
    assert torch.equal(fresh.quantize(x), hif8_qdq_scaled(x, s(3))) and not fresh.initialized
    assert fresh.history_values() == []


class _NoSync:
    """Make every host-synchronising tensor accessor raise while active."""

    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.names}

        def boom(*a, **k):
            raise AssertionError("host sync in the scaler hot path")

        for n in self.names:
            setattr(torch.Tensor, n, boom)

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("algo", ["max", "most_recent", "mean"])
@pytest.mark.parametrize("unit", ["call", "step"])
def test_no_host_sync_per_call(algo, unit):
    cfg = ScalingConfig(algo=algo, history_len=4, interval={0: 1, 2: 2}, history_unit=unit)
    assert_no_host_sync(BankedScaler.standalone("A", cfg), steps=6, observe=True)


def assert_no_host_sync(sc, steps: int, observe: bool = False) -> None:
    """Steps of quantize calls (after one warm-up call, outside the guard) never copy to the host."""
    x = torch.randn(32, 32)
    sc.quantize(x)  # warm up lazy imports / compiled kernels outside the guard
    with _NoSync():
        for step in range(steps):
            sc.set_step(step)
            if observe:
                sc.observe_amax(torch.tensor(float(step + 1)))
            sc.quantize(x * (step + 1))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hif8", "hybrid", "e4m3"])
def test_no_host_sync_on_cuda(fmt):
    """Also for FP8: on CPU at torch 2.11 the compiled FP8 kernel's guard reads a tensor accessor on each call (the
    CPU guard above sees it); here CUDA's own sync check says whether that is a device sync, and a compile that
    fails (a RuntimeWarning, then eager) fails the test."""
    cfg = ScalingConfig(format=fmt, algo="max", history_len=8, interval={0: 1, 2: 3})
    sc = BankedScaler.standalone("A", cfg, device="cuda")
    x = torch.randn(256, 256, device="cuda")
    sc.quantize(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            for step in range(6):
                sc.set_step(step)
                sc.quantize(x * (step + 1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sc.history_values()[-1] == pytest.approx(x.abs().max().item() * 6)


@pytest.mark.parametrize("algo", ["max", "most_recent", "mean", "exp_smooth"])
def test_replay_rows_equals_each_trace_replayed_alone(algo):
    """Many traces in one bank (the report's replay) give every trace the scales of its own one-row replay."""
    gen = torch.Generator().manual_seed(7)
    traces = torch.rand(5, 23, generator=gen) * torch.logspace(-2, 3, 5).unsqueeze(1)
    traces[1, 4] = 0.0  # an all-zero call
    traces[2, :3] = 0.0  # a cold start on zeros
    cfg = ScalingConfig.from_dict({"algo": algo, "history_len": 6, "interval": 1})
    together = replay_rows(traces, cfg, role="G")
    for i, trace in enumerate(traces):
        assert torch.equal(together[i], replay(trace, cfg, role="G")), i
