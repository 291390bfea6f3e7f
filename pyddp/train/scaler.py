"""fp16 loss scaling for the Trainer, on GradScaler's schedule: start at 2**16,
halve and skip the step when gradients overflow, double after 2000 clean
steps. Its whole state (scale and clean-step count) goes into checkpoints: a
resumed run doubles the scale at the same step as an uninterrupted one."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

_GROWTH_INTERVAL = 2000


class LossScaler:
    def __init__(self, enabled: bool):
        # fp16 alone. Not read off the scale: one that overflowed down to 1.0
        # (16 in a row, or resumed there) must keep checking, as GradScaler.
        self.enabled = enabled
        self.scale = 2.0**16 if enabled else 1.0
        self.clean_steps = 0  # steps since the scale last changed

    def unscale_(
        self, flats: Sequence[List[torch.Tensor]], finite: Optional[Callable[[], bool]] = None
    ) -> bool:
        """Divides every replica's gradients (flats[r]: its flat buffers) by the
        scale; False (and a halved scale) if they overflowed. Replicas hold the
        same reduced values, so replica 0's check decides for all, unless
        `finite` decides (sharded gradients: each replica holds its block only)."""
        if finite is None:
            finite = lambda: all(bool(torch.isfinite(f).all()) for f in flats[0])  # noqa: E731
        if not finite():
            self.scale /= 2
            self.clean_steps = 0
            return False
        for grads in flats:
            torch._foreach_mul_(grads, 1.0 / self.scale)
        self.clean_steps += 1
        if self.clean_steps >= _GROWTH_INTERVAL:
            self.scale *= 2
            self.clean_steps = 0
        return True

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self.enabled:  # (as GradScaler: a disabled one loads nothing)
            self.scale = float(state["scale"])
            self.clean_steps = int(state["clean_steps"])
