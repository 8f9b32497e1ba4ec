"""A scaler bank saved in the middle of an exp_smooth refresh block and loaded into a fresh model holds the
saving bank's current scale: a frozen evaluation after the load uses exactly the scales training had reached
(a training resume hides a wrong one, as the block's next refresh overwrites it)."""

from __future__ import annotations

import torch

from hif8qat.models.loading import build_tiny_llama
from hif8qat.quant.linear import (
    _convert_model,
    freeze_scales,
    load_quant_state_dict,
    quant_linears,
    quant_state_dict,
    set_step,
)
from hif8qat.scaling.settings import ScalingConfig

ONE_THREAD = True
CONFIG = ScalingConfig(algo="exp_smooth", history_len=8, interval=4)


def _model(seed: int):
    model, _ = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=seed)
    _convert_model(model, "mlp", None, CONFIG)
    return model


def _train(model, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        set_step(model, step)
        ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(step))
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _bank(model):
    (bank,) = {id(layer.bank): layer.bank for _, layer in quant_linears(model)}.values()
    return bank


def test_a_bank_loaded_mid_block_holds_the_saving_banks_scale():
    saving = _model(0)
    _train(saving, 30)  # past the forecaster's warm-up; blocks of 4: the state is saved part-way through one
    bank = _bank(saving)
    mid = (bank.blk_size > 1) & (bank.block_j > 0)
    assert mid.any()  # the precondition: rows in the middle of a multi-scale block
    rows = torch.as_tensor(mid)
    first = bank.blk_scale[:, 0]
    assert not torch.equal(bank.scale[rows], first[rows])  # the current scale is not the block's first one

    loaded = _model(9)
    load_quant_state_dict(loaded, quant_state_dict(saving))
    freeze_scales(loaded, True)
    torch.testing.assert_close(_bank(loaded).scale, bank.scale, rtol=0, atol=0)
    torch.testing.assert_close(_bank(loaded).est, bank.est, rtol=0, atol=0)
