"""Statistics for the claims, pure functions: ``paired`` (run vs baseline per item and seed),
``item_flips`` (the exact item-level flip model of accuracy) and ``heldout``
(per-token held-out distances). Layer 6: imports only the base modules, numpy, scipy and statsmodels.
"""
