"""The usual route for large models: built on the meta device, converted, materialised with to_empty and given
its weights by a state-dict load; it then trains exactly as the same model converted with its weights in place."""

from __future__ import annotations

import torch
from test_quant_linear import tiny_llama
from transformers import LlamaForCausalLM

from hif8qat import Hif8TrainingConfig, convert_to_hif8_training


def _loss_and_grads(model, ids):
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_model_built_on_meta_converts_materialises_loads_and_trains_like_one_converted_in_place():
    reference = tiny_llama(num_layers=2).train()
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    config = Hif8TrainingConfig()
    convert_to_hif8_training(reference, config=config)

    with torch.device("meta"):
        model = LlamaForCausalLM(reference.config)
    convert_to_hif8_training(model, config=config)
    model.to_empty(device="cpu")
    loaded = model.load_state_dict(weights, strict=False)
    assert loaded.unexpected_keys == [] and all("hif8_scaler" in k for k in loaded.missing_keys)
    model.tie_weights()
    # Non-persistent buffers (the rotary inv_freq) are in no state dict: any meta-built model recomputes them.
    saved = set(weights)
    for name, buffer in reference.named_buffers():
        if name not in saved:
            model.get_buffer(name).copy_(buffer)
    model.train()

    ids = torch.randint(0, reference.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the second step reads the scales the first one recorded
        want_loss, want_grads = _loss_and_grads(reference, ids)
        got_loss, got_grads = _loss_and_grads(model, ids)
        assert torch.equal(got_loss, want_loss)
        assert want_grads.keys() == got_grads.keys()
        for name, grad in want_grads.items():
            assert torch.equal(got_grads[name], grad), name
