"""The options a softmax loss module holds; the computation lives in the functional form."""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from contrastive_dist.losses._checks import check_chunk_size, check_temperature

__all__ = ["TemperatureLoss"]


class TemperatureLoss(nn.Module):
    """Holds ``temperature`` (used when ``forward`` gets no ``logit_scale``), ``chunk_size`` and ``group``."""

    def __init__(self, *, temperature: float, chunk_size: int | None, group: ProcessGroup | None) -> None:
        super().__init__()
        self.temperature = check_temperature(temperature)
        self.chunk_size = check_chunk_size(chunk_size)
        self.group = group

    def extra_repr(self) -> str:
        """Show the options in ``repr``."""
        return f"temperature={self.temperature}, chunk_size={self.chunk_size}"
