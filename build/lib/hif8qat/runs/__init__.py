"""Run-level records: ``folders`` (where a run lives, what it records about itself, how reruns treat it) and
``downloads`` (the network sources the project touches). Layer 8: imports ``config``, ``compute_dtype`` and the
base modules.
"""
