"""Statistics for the claims, pure functions: ``paired`` (run vs baseline per item and seed) and ``heldout``
(per-token held-out distances). Layer 6: imports only the base modules, numpy, scipy and statsmodels.
"""
