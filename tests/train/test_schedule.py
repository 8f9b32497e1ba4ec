"""The learning-rate schedule equals transformers' cosine-with-warmup bit for bit, and a checkpoint's scheduler
state moves between the two."""

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from hif8qat.train.schedule import warmup_cosine_schedule

ONE_THREAD = True


def _optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(scheduler, optimizer, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("warmup,total,lr", [(0, 1, 1e-4), (0, 40, 1e-4), (4, 40, 3e-4), (40, 40, 1e-4),
                                             (100, 30_000, 1e-5), (7, 13, 2.5e-5), (50, 10, 1e-4)])
def test_every_step_equals_transformers_schedule(warmup, total, lr):
    ours_opt, theirs_opt = _optimizer(lr), _optimizer(lr)
    ours = warmup_cosine_schedule(ours_opt, warmup, total)
    theirs = get_cosine_schedule_with_warmup(theirs_opt, warmup, total)
    steps = total + 3  # past the end too (the trainer never goes there)
    got, expected = _lrs(ours, ours_opt, steps), _lrs(theirs, theirs_opt, steps)
    assert got == expected  # exact float equality
    assert expected[0] == (lr if warmup == 0 else 0.0)
    if total > warmup:
        assert expected[total] == 0.0 and max(expected) == lr  # down to 0 at the last step, from the peak


def test_scheduler_state_moves_between_the_two_mid_run():
    theirs_opt, ours_opt = _optimizer(1e-4), _optimizer(1e-4)
    theirs = get_cosine_schedule_with_warmup(theirs_opt, 5, 20)
    _lrs(theirs, theirs_opt, 9)  # a checkpoint written by the old trainer at step 9
    ours = warmup_cosine_schedule(ours_opt, 5, 20)
    ours.load_state_dict(theirs.state_dict())
    ours_opt.load_state_dict(theirs_opt.state_dict())
    assert _lrs(ours, ours_opt, 11) == _lrs(theirs, theirs_opt, 11)
