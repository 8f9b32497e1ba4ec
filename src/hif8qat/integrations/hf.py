"""``transformers.Trainer`` glue: :class:`StepCallback` tells a converted model the optimizer step.

    from hif8qat.integrations.hf import StepCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[StepCallback()])

Trainer already checkpoints what a resume needs: the scalers and the stochastic-rounding generator are in
``model.state_dict()`` (``model.safetensors``), and the step comes back with ``state.global_step``.
"""

from __future__ import annotations

from transformers import TrainerCallback

from hif8qat.quant.linear import set_step


class StepCallback(TrainerCallback):
    """Calls :func:`hif8qat.set_step` with ``state.global_step`` before every optimizer step (the step the
    schedules ``interval`` / ``algo``, ``history_unit="step"`` and telemetry dump steps follow)."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        """Tell the model's quantizers the optimizer step that begins.

        Args:
            args: the trainer's arguments.
            state: the trainer's state (its ``global_step``).
            control: the trainer's control flags.
            model: the model being trained.
            **kwargs: the rest of the trainer's callback arguments.

        Returns:
            ``control``, unchanged.
        """
        set_step(model, state.global_step)  # an unconverted model is refused there, with what to do
        return control


__all__ = ["StepCallback"]
