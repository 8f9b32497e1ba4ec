"""README's table of Hif8TrainingConfig's fields is the one the config builds, and it covers every field."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from hif8qat import Hif8TrainingConfig
from hif8qat.quant.training import config_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_holds_the_generated_config_table():
    text = README.read_text(encoding="utf-8")
    block = re.search(r"<!-- config-table[^>]*-->\n(.*?)\n<!-- /config-table -->", text, re.S)
    assert block is not None, "README.md has no config-table block"
    assert block.group(1) == config_table(), \
        "rewrite it from python -c 'from hif8qat.quant.training import config_table; print(config_table())'"


def test_the_table_names_every_field_with_its_default():
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2].strip().strip("`")
            for line in config_table().splitlines()[2:]}
    fields = {f.name: repr(f.default) for f in dataclasses.fields(Hif8TrainingConfig)}
    assert rows == fields


@pytest.mark.parametrize("field", ["algo", "history_unit", "amax_reduce", "grad_rounding", "format", "scope"])
def test_the_listed_values_are_exactly_the_accepted_ones(field):
    row = next(line for line in config_table().splitlines() if line.startswith(f"| `{field}` "))
    listed = re.findall(r"`([a-z0-9_]+)`", row.split("|")[3].split(",")[0].split(" (")[0])
    for value in listed:
        extra = {"format": "hif8"} if field == "grad_rounding" else {}
        Hif8TrainingConfig(**{field: value, **extra})
    with pytest.raises(ValueError, match=f"Hif8TrainingConfig.{field}="):
        Hif8TrainingConfig(**{field: "not_a_value"})
