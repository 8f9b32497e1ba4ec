"""Two duties of the scaler bank beside delayed scaling, as a mixin of :class:`~hif8qat.scaling.bank.ScalerBank`:

* **The stochastic-rounding generator.** ``grad_rounding="stochastic"`` draws its random bits from the bank's own
  ``torch.Generator``, never torch's global one, so that its state travels in the model's state dict
  (``hif8qat_bank.rng_seed`` / ``rng_state``, where the quantizers' state is) and a resume is bit for bit whatever
  else a trainer saves or seeds. It is seeded from ``torch.initial_seed()`` without drawing from the global
  generator: processes seeded alike (data-parallel ranks included) draw alike. A bank without stochastic rows has
  no generator and draws nothing, so the default path's random streams are untouched.
* **The missing-``set_step`` warning.** A config whose scales depend on the step (schedules, ``history_unit``
  ``step``) warns once when the weights changed (an optimizer step, seen through the first weight row's version
  counter) and no ``set_step`` came since.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from hif8qat.scaling.autograd_engine import tensor_version

_SEED_MIX = 0x5DEECE66D2B7E151  # mixed into the global seed: the bank's stream is not the global one's
RNG_KEYS = ("rng_seed", "rng_state")


class BankExtras:
    """Mixin: the generator and the step watch. The bank calls :meth:`_init_extras` from its ``__init__``."""

    def _init_extras(self) -> None:
        self.rng_seed = ((torch.initial_seed() ^ _SEED_MIX) & ((1 << 63) - 1)
                         if "stochastic" in self._rounding else None)
        self._rng: torch.Generator | None = None
        self.rng_in_state_dict = False  # see hif8qat.quant.linear.set_state_in_state_dict
        needs_step = len(self._algo_sched) > 1 or len(self._interval_sched) > 1 or self._step_mode
        self._watch_row = self.roles.index("W") if needs_step and "W" in self.roles else -1
        self._seen_version: int | None = None
        self._step_warned = False

    # -- the generator -------------------------------------------------------------------------------
    def generator(self) -> torch.Generator | None:
        """The generator stochastic rounding draws from (on the bank's device; None without stochastic rows).
        A device move starts it again from its seed on the new device (CPU and CUDA states do not convert).

        Returns:
            The generator, or None.
        """
        if self.rng_seed is None:
            return None
        if self._rng is None or self._rng.device != self.device:
            self._rng = torch.Generator(device=self.device)
            self._rng.manual_seed(self.rng_seed)
        return self._rng

    def _rng_for(self, row: int) -> torch.Generator | None:
        return self.generator() if self._rounding[row] == "stochastic" else None

    def _copy_rng_into(self, new) -> None:
        new._rng = None
        if self._rng is not None:  # a generator does not deep-copy: the copy continues from the same state
            new._rng = torch.Generator(device=self._rng.device)
            new._rng.set_state(self._rng.get_state())

    def rng_state_dict(self) -> dict[str, torch.Tensor]:
        """``{"rng_seed", "rng_state"}`` (CPU tensors) of the stochastic-rounding generator; empty without one.

        Returns:
            The saved generator state.
        """
        gen = self.generator()
        if gen is None:
            return {}
        return {"rng_seed": torch.tensor(self.rng_seed, dtype=torch.int64), "rng_state": gen.get_state().clone()}

    def load_rng_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what :meth:`rng_state_dict` saved.

        Args:
            state: the saved generator state.

        Raises:
            ValueError: this bank has no stochastic rounding, or the state is another device type's.
        """
        if self.rng_seed is None:
            raise ValueError("saved stochastic-rounding generator state, but this model's grad_rounding is "
                             f"{self.config.grad_rounding!r}; convert it with grad_rounding='stochastic' to load it")
        self.rng_seed, self._rng = int(state["rng_seed"]), None
        try:
            self.generator().set_state(state["rng_state"].to(device="cpu", dtype=torch.uint8))
        except RuntimeError as err:
            raise ValueError(f"stochastic-rounding generator state does not fit a {self.device.type} generator "
                             f"({err}); load it on the device type it was saved from") from None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.rng_in_state_dict:
            destination.update({prefix + k: v for k, v in self.rng_state_dict().items()})

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        mine = {k: state_dict[prefix + k] for k in RNG_KEYS if prefix + k in state_dict}
        super()._load_from_state_dict({k: v for k, v in state_dict.items() if not k.startswith(prefix)}, prefix,
                                      local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if not self.rng_in_state_dict:
            unexpected_keys.extend(prefix + k for k in mine)
        elif len(mine) == len(RNG_KEYS):
            try:
                self.load_rng_state_dict(mine)
            except ValueError as err:
                error_msgs.append(f"{prefix}rng_state: {err}")
        elif self.rng_seed is not None and strict:
            missing_keys.extend(prefix + k for k in RNG_KEYS if k not in mine)

    # -- the step watch ------------------------------------------------------------------------------
    def _watch_step(self, row: int, weight: torch.Tensor) -> None:
        if row != self._watch_row:
            return
        version, seen = tensor_version(weight), self._seen_version
        self._seen_version = version
        if seen is None or version == seen or self._step_warned:
            return
        self._step_warned = True
        warnings.warn(
            "hif8qat: the quantized weights changed (an optimizer step) but set_step was not called since: the "
            f"step schedules of this config (algo={self.config.algo!r}, interval={self.config.interval!r}, "
            f"history_unit={self.config.history_unit!r}) stay at step {self.step}. Call "
            "hif8qat.set_step(model, step) before each optimizer step (transformers.Trainer: "
            "callbacks=[hif8qat.integrations.hf.StepCallback()])", UserWarning, stacklevel=3)


__all__ = ["RNG_KEYS", "BankExtras"]
