"""Dataset cards parsed with libyaml during an evaluation (:func:`hif8qat.evaluate.task_data.libyaml_safe_load`):
the same values as PyYAML's pure-Python safe loader (the oracle), the function restored after, and the evaluation's
lm-eval setup run inside it."""

from __future__ import annotations

import pytest
import yaml

from hif8qat.evaluate import runner
from hif8qat.evaluate.task_data import libyaml_safe_load, local_splits
from hif8qat.models.loading import build_tiny_llama

# the shapes a hub dataset card's header holds: configs with data files per split, dataset_info with features,
# quoted and plain scalars, numbers, booleans, nulls, a date-like string, unicode, anchors
CARD = """
annotations_creators: [no-annotation]
language: [en]
license: mit
pretty_name: "Measuring Massive Multitask Language Understanding: é, ü, 中文"
configs:
- config_name: abstract_algebra
  data_files:
  - split: test
    path: abstract_algebra/test-*
  - {split: validation, path: "abstract_algebra/validation-*"}
- config_name: anatomy
  data_files: &files
  - split: test
    path: anatomy/test-*
- config_name: again
  data_files: *files
dataset_info:
  features:
  - name: answer
    dtype:
      class_label:
        names: {'0': A, '1': B}
  splits:
  - {name: test, num_bytes: 19316, num_examples: 100}
  download_size: 1.5e3
  created: 2021-01-12
  gated: false
  extra: null
  tilde: ~
  octal_like: 0755
"""


def test_cards_parse_to_the_pure_python_loaders_values_and_the_function_is_restored():
    python_safe_load = yaml.safe_load
    expected = yaml.load(CARD, Loader=yaml.SafeLoader)
    with libyaml_safe_load():
        assert yaml.safe_load is not python_safe_load
        assert yaml.safe_load(CARD) == expected
    assert yaml.safe_load is python_safe_load
    with pytest.raises(RuntimeError), libyaml_safe_load():
        raise RuntimeError("an evaluation that fails")
    assert yaml.safe_load is python_safe_load


def test_local_splits_reads_the_cards_configs(tmp_path):
    (tmp_path / "README.md").write_text("---" + CARD + "---\n# card\n")
    assert local_splits(tmp_path, "abstract_algebra") == {"test", "validation"}
    assert local_splits(tmp_path, "again") == {"test"}
    assert local_splits(tmp_path, "missing") is None


def test_an_evaluation_builds_its_tasks_under_libyaml(tmp_path, monkeypatch):
    python_safe_load, seen = yaml.safe_load, []
    real = runner._select_subsets

    def spy(*args, **kwargs):
        seen.append(yaml.safe_load is not python_safe_load)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "_select_subsets", spy)
    model, tok = build_tiny_llama(num_layers=1, hidden_size=32, intermediate_size=64)
    runner.evaluate_model(model, tok, "mini_arc", out_dir=tmp_path / "out", limit=2, batch_size=4)
    assert seen == [True] and yaml.safe_load is python_safe_load
