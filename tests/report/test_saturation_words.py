"""The claims section's saturation telemetry: the replay's shares and each pair's mean (sd) over seeds, as written."""

import pandas as pd

from hif8qat.report.saturation import saturation_section


def test_replay_and_pairs_in_words():
    replay = pd.DataFrame([
        {"trace_source": "exp3/seed0", "estimator": "max(64)", "role": "A", "traces": 2, "calls": 9,
         "frac_exceeded": 0.9, "frac_beyond_2bit_tier": 0.0},
        *({"trace_source": "exp6/seed0", "estimator": est, "role": role, "traces": 75, "calls": 2850,
           "frac_exceeded": f, "frac_beyond_2bit_tier": 0.001 if role == "G" else 0.0}
          for est, fs in (("most_recent(30)", (0.46, 0.1, 0.5)), ("max(64)", (0.079, 0.0, 0.04)))
          for role, f in zip("AWG", fs, strict=True)),
    ])
    pairs = pd.DataFrame([
        {"experiment": "exp11", "counterpart": "exp8", "seed": s, "format": "hybrid", "algo": "max",
         "cp_format": "hif8", "cp_algo": "max", "calls_exceeded": ce, "cp_calls_exceeded": 0.1,
         "clipped_per_stats_call": cl, "cp_clipped_per_stats_call": 0.0}
        for s, ce, cl in ((0, 0.10, 0.1), (1, 0.20, 0.3))])
    pairs = pd.concat([pairs, pd.DataFrame([{
        "experiment": "exp4", "counterpart": "exp3", "seed": 0, "format": "hif8",
        "algo": '{"0": "most_recent", "4": "exp_smooth"}', "cp_format": "hif8", "cp_algo": "most_recent",
        "calls_exceeded": 0.444, "cp_calls_exceeded": 0.42, "clipped_per_stats_call": 0.0,
        "cp_clipped_per_stats_call": 0.0}])])
    text = "\n".join(saturation_section(pairs, replay, "mini"))
    assert "recorded in exp6/seed0" in text and "2,850 calls per role" in text  # the recipe's traces, not exp3's
    assert "| most_recent(30) | 46.0 % | 10.0 % | 50.0 % | 0.0 % / 0.0 % / 0.1 % |" in text
    assert "| max(64) | 7.9 % | 0.0 % | 4.0 % |" in text
    # two seeds: mean 15.0 %, sd of (10, 20) = 7.07 %; clipped mean 0.20, sd 0.14
    assert "| exp11 (hybrid, max) | exp8 (hif8, max) | 0,1 | 15.0 % (sd 7.1 %) vs 10.0 % (sd 0.0 %) | " \
           "0.20 (sd 0.14) vs 0.00 (sd 0.00) |" in text
    assert "exp4 (hif8, most_recent, exp_smooth from step 4)" in text and "| 0 | 44.4 % vs 42.0 % |" in text
    assert saturation_section(pd.DataFrame(), pd.DataFrame(), "mini") == []
