"""A setting recorded on only one side (in the checkpoint's provenance but not in this run's, or the other way
round) is a mismatch, whatever its value (None included), not a setting both sides agree on."""

from __future__ import annotations

import pytest

from hif8qat.train.provenance import provenance_differences

BOTH = {"train.lr": 0.001, "quant": {"algo": "max", "history_len": 16}}


def test_equal_records_have_no_differences():
    assert provenance_differences(BOTH, {"train.lr": 0.001, "quant": {"history_len": 16, "algo": "max"}}) == []


@pytest.mark.parametrize("value", [None, 0, "max"])
def test_a_setting_only_the_checkpoint_recorded_is_a_mismatch(value):
    recorded = {**BOTH, "train.micro_batch_size": value}
    (line,) = provenance_differences(recorded, BOTH)
    assert line == f"train.micro_batch_size: checkpoint {value!r}, this run '(not set)'"


@pytest.mark.parametrize("value", [None, 0, "max"])
def test_a_setting_only_this_run_has_is_a_mismatch(value):
    expected = {**BOTH, "quant": {**BOTH["quant"], "target": value}}
    (line,) = provenance_differences(BOTH, expected)
    assert line == f"quant.target: checkpoint '(not recorded)', this run {value!r}"


def test_a_differing_nested_setting_is_named_by_its_dotted_name():
    other = {**BOTH, "quant": {**BOTH["quant"], "history_len": 64}}
    assert provenance_differences(BOTH, other) == ["quant.history_len: checkpoint 16, this run 64"]
