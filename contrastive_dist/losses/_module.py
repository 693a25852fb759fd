"""The options a softmax loss module holds; the computation lives in the functional form."""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from contrastive_dist.losses._options import (
    Communication,
    Reduction,
    check_chunk_size,
    check_communication,
    check_reduction,
    check_temperature,
)

__all__ = ["TemperatureLoss"]


class TemperatureLoss(nn.Module):
    """Holds ``temperature`` (used without ``logit_scale``), ``chunk_size``, ``group``, ``reduction`` and the mode."""

    def __init__(
        self,
        *,
        temperature: float,
        chunk_size: int | None,
        group: ProcessGroup | None,
        reduction: Reduction = "mean",
        communication: Communication = "gather",
    ) -> None:
        super().__init__()
        self.reduction = check_reduction(reduction, None)
        self.temperature = check_temperature(temperature)
        self.chunk_size = check_chunk_size(chunk_size)
        self.group = group
        self.communication = check_communication(communication)

    def extra_repr(self) -> str:
        """Show the options in ``repr``."""
        return (
            f"temperature={self.temperature}, chunk_size={self.chunk_size}, reduction={self.reduction!r}, "
            f"communication={self.communication!r}"
        )
