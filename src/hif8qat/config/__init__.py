"""Run settings: the typed, validated run configuration and the tables it checks names against.

``run_config`` (``RunConfig``: every setting, its type, range and allowed values), ``schema`` (the path rule and
type checks), ``blocks`` (which blocks stay in high precision), ``eval_tasks`` (tasks, suites, modes).
Layer 4: imports ``scaling.settings`` and the base modules; torch-free, so a bad setting fails in a second.
"""
