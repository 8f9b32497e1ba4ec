"""One quantizer (a row of a :class:`~hif8qat.scaling.bank.ScalerBank`) seen as a scaler of its own."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from hif8qat.scaling.bank import RECORD_NO_GRAD, ScalerBank
from hif8qat.scaling.settings import LAST_CALL_FIELDS, ScalingConfig


class BankedScaler:
    """Row ``row`` of a bank seen as one scaler.

    A layer's ``scaler_a`` / ``scaler_w`` / ``scaler_g`` are such views of the model's bank. A standalone
    one (:meth:`standalone`) owns a one-row bank and ends the micro-batch after each call: the scaler of
    :func:`hif8qat.scaling.replay.replay` and of the tests. ``set_step`` / ``freeze`` act on the whole bank.
    """

    def __init__(self, bank: ScalerBank, row: int, *, own: bool = False):
        self.bank, self.row, self._own = bank, int(row), own

    @classmethod
    def standalone(cls, role: str, config: ScalingConfig | None = None, target: float | None = None, *,
                   device: torch.device | str | None = None) -> BankedScaler:
        """A scaler with a one-row bank of its own.

        Args:
            role: "A", "W" or "G".
            config: the scaling settings (default ``ScalingConfig()``).
            target: a scale target overriding the format's (a finite number > 0).
            device: where the bank's tables live.

        Returns:
            The scaler.

        Raises:
            ValueError: an invalid ``target`` or role.
        """
        bank = ScalerBank(config, [role], device=device)
        if target is not None:
            if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
                raise ValueError(f"BankedScaler target={target!r} is invalid; allowed: a finite number > 0")
            bank.targets[0] = float(target)
            bank.target.fill_(float(target))
            bank.scale.fill_(float(target))
        return cls(bank, 0, own=True)

    # -- one quantizer's view -----------------------------------------------------------------------
    role = property(lambda self: self.bank.roles[self.row])
    config = property(lambda self: self.bank.config)
    target = property(lambda self: self.bank.targets[self.row])
    fmt = property(lambda self: self.bank.formats[self.row])
    history = property(lambda self: self.bank.history[self.row])
    total = property(lambda self: self.bank.total[self.row])
    tel_cnt = property(lambda self: self.bank.tel_cnt[self.row])
    est_block = property(lambda self: self.bank.est[self.row:self.row + 1])
    scale = property(lambda self: self.bank.scale[self.row])
    initialized = property(lambda self: bool(self.bank.initialized[self.row]))
    frozen = property(lambda self: self.bank.frozen)
    _forecaster = property(lambda self: self.bank.forecasters[self.row])

    @property
    def last(self) -> dict[str, torch.Tensor]:
        v = torch.cat((self.bank.last_vals[self.row], self.bank.last_stats[self.row]))
        return dict(zip(LAST_CALL_FIELDS, v.unbind()))

    def set_step(self, step: int) -> None:
        """Set the optimizer step of the next calls.

        Args:
            step: the step.
        """
        self.bank.set_step(step)

    def freeze(self, frozen: bool = True) -> None:
        """Freeze (quantize with the current scale, record nothing) or resume.

        Args:
            frozen: True to freeze.
        """
        self.bank.freeze(frozen)

    def reset(self) -> None:
        self.bank.reset([self.row])

    def _end(self) -> None:
        if self._own:
            self.bank.update()

    @torch.no_grad()
    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize one forward-only call and end its micro-batch.

        Args:
            x: the tensor.

        Returns:
            The fake-quantized tensor.
        """
        y = self.bank.quantize(x, self.row, RECORD_NO_GRAD)
        self._end()
        return y

    @torch.no_grad()
    def observe_amax(self, amax: float | torch.Tensor) -> torch.Tensor:
        """A call with a known amax and no tensor (replay), ending its micro-batch.

        Args:
            amax: the call's amax.

        Returns:
            The scale the call used.

        Raises:
            RuntimeError: the scaler is frozen.
        """
        if self.bank.frozen:
            raise RuntimeError("observe_amax on a frozen scaler")
        scale = self.bank.observe(self.row, torch.as_tensor(amax, dtype=torch.float32))
        self._end()
        return scale

    def history_values(self) -> list[float]:
        """The recorded amaxes, oldest first (at most the history length).

        Returns:
            The values.
        """
        self.bank.update()
        n = min(int(self.total.item()), self.history.numel())
        return self.history.tolist()[self.history.numel() - n:] if n else []

    def telemetry_record(self) -> dict[str, Any]:
        """This row's telemetry.

        Returns:
            The row's record of :meth:`ScalerBank.telemetry_records`.
        """
        return self.bank.telemetry_records()[self.row]

    def telemetry_calls(self) -> tuple[int, int]:
        """How many calls ran, and how many of them computed statistics.

        Returns:
            ``(calls, statistics calls)``.
        """
        return int(self.bank.tel_calls[self.row]), int(self.bank.tel_stat_calls[self.row])

    def reset_telemetry(self) -> None:
        if not self._own:
            raise RuntimeError("reset_telemetry of one row of a shared bank: use bank.reset_telemetry()")
        self.bank.reset_telemetry()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The row's saved state.

        Returns:
            The state (CPU tensors; keys ``settings.STATE_KEYS``).
        """
        return self.bank.row_state_dict(self.row)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Restore the row's saved state.

        Args:
            state_dict: the saved state.
            strict: refuse missing or unexpected keys.
        """
        self.bank.load_row_state_dicts({self.row: state_dict}, strict=strict)


__all__ = ["BankedScaler"]
