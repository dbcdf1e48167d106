"""A test guard for the device seam: every tensor factory call must name the device, and land on it.

    with DeviceGuard("cpu") as guard:
        ...  # build the pool, a step's metadata, run a step
    assert not guard.violations, guard.report()

A factory call (torch.tensor, empty, zeros, arange, full, ...) without `device=` lands on the default
device, which on a GPU machine is not the configured one: on the CPU such a call works and a test would
never see it, so the guard records it either way. A call whose tensor lands elsewhere is recorded too.
`*_like` and `Tensor.new_*` calls inherit their input's device and are not checked.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.linspace,
    torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm, torch.empty_strided,
})


@dataclass(frozen=True)
class Violation:
    factory: str
    device: torch.device | None  # where the tensor landed
    named_device: bool  # whether the call said where
    where: str  # the package frame that made the call

    def __str__(self) -> str:
        reason = "no device= given" if not self.named_device else f"landed on {self.device}"
        return f"torch.{self.factory} ({reason}) at {self.where}"


def _caller() -> str:
    """The innermost frame outside this file and torch: the code that made the call."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename != __file__ and "/torch/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} {frame.line}"
    return "?"


class DeviceGuard(TorchFunctionMode):
    """Records (never raises) every factory call off `device` or not naming it, in `violations`."""

    def __init__(self, device: str | torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.violations: list[Violation] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in FACTORIES:
            landed = result.device if isinstance(result, torch.Tensor) else None
            named = kwargs.get("device") is not None
            if not named or not self._on_device(landed):
                self.violations.append(Violation(func.__name__, landed, named, _caller()))
        return result

    def _on_device(self, device: torch.device | None) -> bool:
        if device is None or device.type != self.device.type:
            return False
        return self.device.index is None or device.index == self.device.index

    def report(self) -> str:
        return "\n".join(str(v) for v in self.violations) or "no violations"
