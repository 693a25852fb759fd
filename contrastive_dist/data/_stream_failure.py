"""A stream whose loader raised on one rank stops on every rank, with the same error naming that rank and why.

:class:`~contrastive_dist.DistributedStreamingBatches` catches whatever its loader raises (an
unreadable shard, a collate error, a DataLoader worker that died) and sends a failed status in the
window's exchange instead of its batches: every rank is at that exchange, so every rank learns it
at once. One more exchange carries each rank's error text (up to :data:`TEXT_BYTES` of it), and
every rank raises the same ``RuntimeError``; on the failing rank it is chained to the original.
The process group stays usable: no rank is left waiting in a collective, nor for its timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch
from torch.distributed import ProcessGroup

from contrastive_dist.data._stream_window import WindowRow, gather_rows

__all__ = ["TEXT_BYTES", "describe_error", "raise_failure"]

TEXT_BYTES = 1536


def describe_error(error: BaseException) -> str:
    r"""``error`` in a line or so; for one a DataLoader worker raised, the worker's own error and which worker.

    Example:
        >>> describe_error(FileNotFoundError(2, "No such file or directory", "part-3.tar"))
        "FileNotFoundError: [Errno 2] No such file or directory: 'part-3.tar'"
        >>> describe_error(RuntimeError("Caught ZeroDivisionError in DataLoader worker process 1.\n"
        ...                             "Original Traceback (most recent call last):\n  ...\n"
        ...                             "ZeroDivisionError: division by zero\n"))
        'ZeroDivisionError: division by zero (in DataLoader worker process 1)'

    """
    text = str(error).strip()
    lines = text.splitlines()
    if len(lines) > 1 and lines[0].startswith("Caught ") and " in DataLoader worker" in lines[0]:
        # torch raises a worker's error again with the worker's traceback as its message: the last line is the error.
        where = lines[0][lines[0].index(" in DataLoader worker") + 1 :].rstrip(".")
        last = lines[-1].strip()
        return last if "DataLoader worker" in last else f"{last} ({where})"
    return f"{type(error).__name__}: {text}"


def raise_failure(table: Sequence[WindowRow], failure: BaseException | None, *, step: int, epoch: int,
                  world_size: int, device: torch.device, group: ProcessGroup | None) -> NoReturn:
    """Raise on every rank the same ``RuntimeError``: whose loader failed at ``step`` and what it raised.

    Every rank calls it for the same window (one in which a rank's status is failed); ``failure`` is
    this rank's error, or None.
    """
    text = b"" if failure is None else describe_error(failure).encode()[:TEXT_BYTES]
    texts = gather_rows(list(text.ljust(TEXT_BYTES, b"\0")), world_size, device, group)
    failed = [rank for rank, row in enumerate(table) if row.failed]
    reasons = "\n".join(f"  rank {rank}: {_text(texts[rank])}" for rank in failed)
    ranks = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {failed}"
    raise RuntimeError(
        f"the data loader of {ranks} raised at step {step} of epoch {epoch}, so every rank stops here:\n{reasons}\n"
        f"The full traceback is in the log of {ranks}. An unreadable shard or sample can be skipped instead: "
        "on_error='skip' (streaming_loader, DistributedShardList.pipeline); the state saved at the last "
        "checkpoint resumes the epoch once the data is fixed"
    ) from failure


def _text(values: list[int]) -> str:
    return bytes(values).rstrip(b"\0").decode(errors="replace")
