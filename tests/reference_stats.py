"""Reference statistics for tests, written from the textbook and sharing nothing with ``hif8qat.stats``: the
crossed seeds x units model's mean, interval and Satterthwaite degrees of freedom from the two-way analysis of
variance without replication (Searle, Casella and McCulloch, Variance Components, 1992, ch. 4; Satterthwaite,
Biometrics Bulletin 2, 1946), in exact rational arithmetic."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from scipy import stats as st


def textbook_crossed(y, conf=0.95):
    """Mean of a balanced seeds x units table, seeds and units crossed random effects, without replication:
    sums of squares, E[MS_seed] = s_e + n s_seed, E[MS_unit] = s_e + k s_unit, E[MS_err] = s_e; a component
    whose estimate is not positive is taken as 0; Var(grand mean) = s_seed / k + s_unit / n + s_e / (k n), its
    degrees of freedom by Satterthwaite (1946): (sum a_i MS_i)^2 / sum (a_i MS_i)^2 / df_i. Computed in
    fractions, so that mean squares equal in exact arithmetic compare equal."""
    Y = [[Fraction(float(v)) for v in row] for row in np.atleast_2d(y)]
    k, n = len(Y), len(Y[0])
    grand = sum(sum(r) for r in Y) / (k * n)
    row = [sum(r) / n for r in Y]
    col = [sum(Y[i][j] for i in range(k)) / k for j in range(n)]
    df_s, df_u, df_e = k - 1, n - 1, (k - 1) * (n - 1)
    ms_s = n * sum((r - grand) ** 2 for r in row) / df_s
    ms_u = k * sum((c - grand) ** 2 for c in col) / df_u
    ms_e = sum((Y[i][j] - row[i] - col[j] + grand) ** 2 for i in range(k) for j in range(n)) / df_e
    s_seed = (ms_s - ms_e) / n if ms_s > ms_e else Fraction(0)
    s_unit = (ms_u - ms_e) / k if ms_u > ms_e else Fraction(0)
    var = s_seed / k + s_unit / n + ms_e / (k * n)
    # the same variance as a combination of the mean squares, k n Var = a_s MS_s + a_u MS_u + a_e MS_e
    a_s, a_u = int(s_seed > 0), int(s_unit > 0)
    terms = [(a_s, ms_s, df_s), (a_u, ms_u, df_u), (1 - a_s - a_u, ms_e, df_e)]
    assert sum(a * ms for a, ms, _ in terms) == var * k * n
    df = float(sum(a * ms for a, ms, _ in terms) ** 2 / sum((a * ms) ** 2 / d for a, ms, d in terms if a))
    se = float(var) ** 0.5
    q = st.t.ppf(0.5 + conf / 2, df)
    return {"mean": float(grand), "se": se, "df": df, "lo": float(grand) - q * se, "hi": float(grand) + q * se,
            "seed_var": float(s_seed), "unit_var": float(s_unit), "resid_var": float(ms_e)}
