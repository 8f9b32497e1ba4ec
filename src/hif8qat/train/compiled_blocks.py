"""``train.compile``: each decoder block compiled on its own, as torchtitan compiles its transformer blocks.

A whole-model ``torch.compile`` traces every block into one graph, so its first step's compile time grows with
the depth (minutes for a 26-block 1B model). Compiled one by one, the blocks of a model are the same code with
different parameters: Dynamo compiles one graph and every block of the same structure reuses it
(:func:`compile_blocks` says how). The embedding, the final norm and the loss head stay eager.
"""

from __future__ import annotations

import torch
from torch import nn

from hif8qat.quant.blocks import find_transformer_blocks


def compile_blocks(model: nn.Module) -> int:
    """Compile each decoder block of ``model`` on its own, in place.

    What differs between two quantized blocks besides their tensors is the rows of the scaler bank their
    layers use (plain ints); they are made graph inputs (``allow_unspec_int_on_nn_module``) instead of
    constants guarded per block, so the number of graphs stays fixed as the model gets deeper. Only each
    block's ``forward`` is compiled, in place: the modules, their names and the state dict keys are those of
    the eager model, and the hooks DDP or FSDP put on a block run outside its graph, as they do on the eager
    model.

    Args:
        model: a causal LM.

    Returns:
        The number of blocks compiled.
    """
    # Ints read from a module (a quantized layer's bank rows) become graph inputs where they differ between
    # calls: one graph serves every block of the same structure.
    torch.compiler.config.allow_unspec_int_on_nn_module = True
    _, blocks = find_transformer_blocks(model)
    # enough cached graphs per block code object for its variants (quantized or BF16 block, train or eval,
    # with and without gradients) while a shape change still recompiles instead of failing
    torch.compiler.config.recompile_limit = max(torch.compiler.config.recompile_limit, 16)
    for block in blocks:
        block.forward = torch.compile(block.forward)  # one code object: every block shares its graph cache
    return len(blocks)
