"""The schema's rules that are not one setting's: the one path rule for every user string that becomes part of
a run's path, and each declared type's check (config.RunConfig applies them to every setting by name)."""

from __future__ import annotations

import math
import re
from typing import Any

# One rule for every user string that becomes one component of a run's path (experiment.name, profile.name):
# a letter or digit first (no "..", no hidden or empty name), then letters, digits and _ . + = -. No "/" can
# enter, so a run folder is always <results_root>/<profile>/<experiment>/seed<k>[-<tag>].
PATH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]{0,99}")
PATH_NAME_RULE = "a name of 1-100 letters, digits and _ . + = - starting with a letter or digit (no /, no ..)"
# Seeds feed numpy's generator (below 2**32) and enter the folder name.
MAX_SEED = 2**32 - 1


def is_path_name(value: Any) -> bool:
    return isinstance(value, str) and PATH_NAME.fullmatch(value) is not None


# Each setting's type, declared once by its dataclass annotation and checked for every setting (whether or
# not the experiment uses it) before any value is compared or any folder exists.
_TYPE_RULES: dict[str, tuple[Any, str]] = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
              "a finite number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list[float]": (lambda v: isinstance(v, (list, tuple)) and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v),
        "a list of finite numbers, e.g. [0.9,0.95]"),
    "list[str]": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
                  "a list of names, e.g. [a,b]"),
    "dict[str, int]": (lambda v: isinstance(v, dict), "a mapping, e.g. {name: 1}"),
    "dict[str, str]": (lambda v: isinstance(v, dict), "a mapping, e.g. {name: value}"),
}


def type_problem(annotation: str, value: Any) -> str | None:
    """What a setting annotated ``annotation`` allows, when ``value`` is not of that type (else None)."""
    optional = annotation.endswith(" | None")
    base = annotation[: -len(" | None")] if optional else annotation
    rule = _TYPE_RULES.get(base)
    if rule is None or (optional and value is None):
        return None  # bool is checked by _validate_booleans; Any-typed settings by their own rules
    ok, allowed = rule
    return None if ok(value) else allowed + (" or null" if optional else "")
