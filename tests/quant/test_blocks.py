"""One block finder (quant.blocks, which models.loading uses too) and one high-precision-block parser
(config/blocks.py): the config parses the spec, the conversion takes the indices; the edges of the spec and which
ModuleList is the decoder stack."""

from __future__ import annotations

import pytest
from torch import nn

from hif8qat.config.blocks import parse_high_precision_blocks
from hif8qat.config.run_config import ConfigError, RunConfig
from hif8qat.models.loading import build_tiny_llama, find_transformer_blocks, transformer_blocks
from hif8qat.quant.linear import find_transformer_blocks as qlinear_finder


# ------------------------------------------------------------------------------------ the parser's edges
@pytest.mark.parametrize(("spec", "depth", "expected"), [
    ([0], 4, [0]),                        # the first block
    ([3], 4, [3]),                        # the last block
    ([0, 1, 2], 4, [0, 1, 2]),            # all but one
    ("first1_last2", 4, [0, 2, 3]),
    ("first3", 4, [0, 1, 2]),
    ("last3", 4, [1, 2, 3]),
    ("first0_last0", 4, []),
    (" 3 , 0 ", 4, [0, 3]),
    (["2", 1, 1], 4, [1, 2]),
    ("none", 4, []), ("", 4, []), (None, 4, []), ([], 4, []),
    ([0, 7], None, [0, 7]),               # depth unknown: only non-negative integers are checked
])
def test_accepted_specs(spec, depth, expected):
    assert parse_high_precision_blocks(spec, depth) == expected


@pytest.mark.parametrize(("spec", "depth", "why"), [
    ([4], 4, "block index 4 out of range 0..3"),          # one past the last block
    ([-1], 4, "block index -1 out of range 0..3"),         # no negative (Python-style) indices
    ([-1], None, "block index -1 out of range"),
    ("-1", 4, "allowed none"),
    ([True], 4, "True is not one"),
    ([1.0], 4, "1.0 is not one"),
    ("middle2", 4, "allowed none"),
    (3, 4, "allowed none"),
    ("first2_last2", 4, "at least one block stays quantized"),   # k + m == depth: nothing quantized
    ("first3_last3", 4, "at least one block stays quantized"),   # overlapping
    ("last4", 4, "at least one block stays quantized"),
    ([0, 1, 2, 3], 4, "left quantized"),                          # a list covering every block
    ("first1", None, "depth"),
])
def test_refused_specs_name_the_setting(spec, depth, why):
    with pytest.raises(ValueError, match="quant.high_precision_blocks") as err:
        parse_high_precision_blocks(spec, depth)
    assert why in str(err.value)


def test_the_config_parses_the_spec_and_the_conversion_takes_indices():
    cfg = RunConfig.from_dict({"model": {"name": "tiny:4"}, "quant": {"high_precision_blocks": "first1_last1"}},
                              check_paths=False)
    assert cfg.high_precision_block_list() == [0, 3]
    cfg.quant.high_precision_blocks = [0, 4]
    with pytest.raises(ConfigError, match=r"block index 4 out of range 0\.\.3.*tiny:4"):
        cfg.high_precision_block_list()


# -------------------------------------------------------------------------------------- the block finder
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(2, 2)


def test_finder_prefers_the_decoder_stack_over_a_longer_other_list():
    model = nn.Module()
    model.heads = nn.ModuleList([nn.Linear(2, 2) for _ in range(9)])
    model.body = nn.Module()
    model.body.layers = nn.ModuleList([_Block() for _ in range(3)])
    name, blocks = find_transformer_blocks(model)
    assert name == "body.layers" and blocks is model.body.layers
    assert qlinear_finder is find_transformer_blocks


def test_finder_on_a_llama_names_its_layers_and_the_root_list_has_an_empty_name():
    model, _ = build_tiny_llama(num_layers=3)
    name, blocks = find_transformer_blocks(model)
    assert name == "model.layers" and blocks is model.model.layers and transformer_blocks(model) is blocks
    stack = nn.ModuleList([_Block(), _Block()])
    assert find_transformer_blocks(stack) == ("", stack)


def test_finder_without_any_module_list_says_what_it_looked_for():
    with pytest.raises(ValueError, match="no ModuleList of decoder layers"):
        find_transformer_blocks(nn.Sequential(nn.Linear(2, 2)))
