"""Delayed tensor scaling: settings, rules, the exp_smooth forecaster, the scaler bank and its state.

``settings`` (``ScalingConfig``, algorithm and role names, the saved-state and telemetry layout), ``rules`` (cold start,
estimators, refresh, amax reduction), ``current`` (just-in-time scaling), ``forecast``, ``bank`` (every quantizer
of a model as rows of one table) with ``bank_row``, ``bank_state``, ``bank_telemetry`` and ``autograd_engine``
(what it asks torch's autograd machinery), and ``replay`` (an amax
trace through the same bank). Layer 3, library core: imports ``formats``, ``errors``, torch and numpy.

Inside, imports run one way: autograd_engine, rules -> settings -> current, forecast -> bank_state,
bank_telemetry -> bank -> bank_row -> replay (a module never imports one to its right; the bank's helpers get the
bank as an argument).
"""
