"""What the quantizers ask torch's autograd machinery: whether a backward pass is running, to run a callback when
it ends, and a tensor's version counter. Torch offers none of them through a public name, so each sits in one
adapter function here, the only place that touches them; a torch release that moves one breaks its function
only."""

from __future__ import annotations

from collections.abc import Callable

import torch


def in_backward() -> bool:
    """Whether the calling code runs inside a backward pass (an activation-checkpointing recompute, or a gradient
    quantizer).

    Adapter: torch has no public query for this; the id of the engine's current graph task is -1 outside one.

    Returns:
        True inside a backward pass.
    """
    return torch._C._current_graph_task_id() != -1


def queue_at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass has finished (call only inside one, see :func:`in_backward`).

    Adapter: the engine's ``queue_callback`` is the one way to act after the last gradient of a pass, and torch
    exposes it only on the private ``Variable._execution_engine``.

    Args:
        callback: called with no arguments when the pass ends.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def tensor_version(tensor: torch.Tensor) -> int:
    """How many times ``tensor`` has been modified in place: equal counts (and the same data pointer) mean the
    same values, without reading them.

    Adapter: the counter autograd checks its saved tensors with is torch's private ``Tensor._version``.

    Args:
        tensor: the tensor.

    Returns:
        Its version counter.
    """
    return tensor._version
