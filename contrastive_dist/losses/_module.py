"""The options a softmax loss module holds; the computation lives in the functional form."""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from contrastive_dist.losses._checks import check_chunk_size, check_temperature
from contrastive_dist.losses._ring_losses import Communication, check_communication

__all__ = ["TemperatureLoss"]


class TemperatureLoss(nn.Module):
    """Holds ``temperature`` (used without ``logit_scale``), ``chunk_size``, ``group`` and ``communication``."""

    def __init__(
        self,
        *,
        temperature: float,
        chunk_size: int | None,
        group: ProcessGroup | None,
        communication: Communication = "gather",
    ) -> None:
        super().__init__()
        self.temperature = check_temperature(temperature)
        self.chunk_size = check_chunk_size(chunk_size)
        self.group = group
        self.communication = check_communication(communication)

    def extra_repr(self) -> str:
        """Show the options in ``repr``."""
        return f"temperature={self.temperature}, chunk_size={self.chunk_size}, communication={self.communication!r}"
