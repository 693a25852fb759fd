"""A peer that vanished is named: transport failures become an error that says who and where to look.

When a rank dies (an exception, out of memory, a kill) or hangs, the other ranks' next collective
fails with the transport's own words: gloo's ``Connection closed by peer [127.0.0.1]:43517`` or
``Timed out waiting 1800000ms for recv operation to complete``, NCCL's ``DistBackendError``. Neither
says which operation of the package was running, which rank failed, or that the cause is in *that*
rank's log. :func:`naming_peers` wraps a collective and turns such a failure into a
:class:`PeerFailureError` that does, chained to the transport's error (``raise ... from``):

* **which operation**: ``gather``, ``ring step 2 of 4``, ``SyncBatchNorm backward``, ...;
* **which peer**: the one rank the failed transfer talked to where the caller knows it (the source
  of a broadcast, a ring neighbour), else the ranks that could be the cause;
* **what to look for**: a closed connection means that rank's process exited or crashed first, so
  its own log holds the real error; a timeout means it is alive but did not join within the
  process group's ``timeout=`` (``init_process_group(timeout=...)``, 30 minutes by default on CPU).

Only transport failures are translated; any other error (a wrong dtype, a ``ValueError`` of the
package) passes through unchanged. The cost is a ``try`` around the collective: nothing on the wire.

**The rank that died, not the neighbour that waited for it.** A transfer talks to one peer or a
few, and with four or more ranks a survivor often waits on a *live* rank (a ring neighbour, or the
next rank of gloo's ring all-gather) that stopped on the same failure. Before raising, a rank whose
transfer failed holds a roll call through the group's store (``_rollcall``), and
:func:`wait_named` waits in short slices, checking between them whether another rank raised the
alarm: every survivor then names the ranks that are gone (``suspects``), within about
:data:`~contrastive_dist.engine._rollcall.ROLL_CALL_S` seconds of the first error, and none waits
for the process group's timeout because a live neighbour stopped sending.

**Collectives that can never meet.** A wait that lasts over a second asks every rank where it
stands (``_crossed``): a rank that skipped a collective the others wait in (a backward), or that
blocks in a collective of ``torch.distributed`` itself, is named within seconds by the same error
on every waiting rank, instead of after the process group's timeout.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from contrastive_dist.engine._crossed import ASK_AFTER_S, crossed, next_ask
from contrastive_dist.engine._progress import begin_operation, waiting
from contrastive_dist.engine._rollcall import alarm_seen, gone_ranks, watch
from contrastive_dist.engine._waiter import in_slices, in_thread

__all__ = ["PeerFailureError", "is_transport_failure", "naming_peers", "wait_named"]

# gloo's words for a peer that went away or never answered (pair.cc, unbound_buffer.cc, context.cc),
# and the generic socket ones; NCCL and the stores raise torch.distributed.DistError subclasses.
_TRANSPORT_WORDS = re.compile(
    r"(closed|reset) by peer|Broken pipe|Connection refused|Socket Timeout|timed out|timeout|pair closure",
    re.IGNORECASE,
)
_TIMEOUT_WORDS = re.compile(r"timed out|timeout", re.IGNORECASE)


class PeerFailureError(RuntimeError):
    """A collective of the package failed because another rank exited, crashed or did not join in time.

    Attributes:
        operation: what this rank was doing, e.g. ``"gather (broadcast of rank 2's rows)"``.
        rank: this process's rank in the group.
        suspects: the group ranks that can have caused it (one where the failed transfer had one peer).
        timed_out: ``True`` when the transport timed out (the peer is alive but stuck elsewhere),
            ``False`` when a connection was closed (the peer's process exited).

    Example:
        >>> from contrastive_dist import PeerFailureError
        >>> error = PeerFailureError("gather failed on rank 0 of 2: ...", operation="gather", rank=0,
        ...                          suspects=[1], timed_out=False)
        >>> isinstance(error, RuntimeError), error.suspects
        (True, (1,))
    """

    def __init__(self, message: str, *, operation: str, rank: int, suspects: Sequence[int], timed_out: bool) -> None:
        super().__init__(message)
        self.operation, self.rank, self.suspects, self.timed_out = operation, rank, tuple(suspects), timed_out

    def __reduce__(self) -> tuple[object, ...]:  # picklable with its keywords (spawned test workers send it back)
        return _rebuild, (str(self), self.operation, self.rank, self.suspects, self.timed_out)


def _rebuild(message: str, operation: str, rank: int, suspects: tuple[int, ...], timed_out: bool) -> PeerFailureError:
    return PeerFailureError(message, operation=operation, rank=rank, suspects=suspects, timed_out=timed_out)


def is_transport_failure(error: BaseException) -> bool:
    """Whether ``error`` is the transport reporting a peer that went away or did not answer in time."""
    if isinstance(error, PeerFailureError):
        return False  # already named (an inner operation): never wrapped twice
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and bool(_TRANSPORT_WORDS.search(str(error)))


@contextmanager
def naming_peers(operation: str, group: ProcessGroup | None, *, peers: Sequence[int] | None = None) -> Iterator[None]:
    """Raise a :class:`PeerFailureError` for a transport failure inside the block.

    Args:
        operation: what the block does, in the words of the error (``"ring step 2 of 4"``).
        group: the process group the collective runs on (``None``: the world).
        peers: the group ranks the block's transfers talk to, where that is one or a few (a
            broadcast's source, a ring neighbour); ``None``: every other rank of the group.

    Example:
        >>> from contrastive_dist.engine._faults import naming_peers
        >>> with naming_peers("gather", None):  # nothing fails: nothing changes
        ...     total = 1 + 1
        >>> total
        2
    """
    try:
        yield
    except RuntimeError as error:
        if not is_transport_failure(error):
            raise
        raise _named(error, operation, group, peers) from error


def wait_named(
    work: dist.Work | None,
    operation: str,
    group: ProcessGroup | None,
    *,
    peers: Sequence[int] | None = None,
    sliced: bool = True,
    point_to_point: bool = False,
) -> None:
    """``work.wait()``, named on failure; in short slices that watch the store for ranks gone elsewhere.

    Args:
        work: the posted collective or transfer (``None``: nothing to wait for).
        operation: what the work does, in the words of the error.
        group: the process group it runs on (``None``: the world).
        peers: the group ranks it talks to, where that is one or a few (``None``: every other rank).
        sliced: whether to wait in slices (CPU tensors; an accelerator's wait only orders its stream).
        point_to_point: a send or receive, whose wait cannot be cut into slices (``_waiter``).
    """
    if work is None:
        return
    with naming_peers(operation, group, peers=peers):
        if torch.compiler.is_compiling():
            work.wait()
            return
        if not point_to_point:  # a ring hop's transfers count once, as one collective (``_ring``)
            begin_operation(group, operation)
        if not sliced:
            work.wait()
            return
        watch(group)
        finished = in_thread(work) if point_to_point else in_slices(work)
        incident, start = 0, time.monotonic()
        ask_at = start + ASK_AFTER_S
        with waiting(group, operation) as record:
            while record.out_of_step or not finished():
                # Still waiting: did a rank elsewhere raise the alarm, and is someone gone?
                newer = alarm_seen(group, incident)
                if newer:
                    gone = gone_ranks(group, incident=newer)
                    if gone:
                        raise _gone_elsewhere(operation, group, peers, gone)
                    incident = newer
                if record.out_of_step or time.monotonic() >= ask_at:  # so long: can this wait ever end?
                    found = crossed(group, operation)
                    if found is not None:
                        raise _out_of_step(operation, group, *found)
                    ask_at = time.monotonic() + next_ask(time.monotonic() - start)


def _gone_elsewhere(
    operation: str, group: ProcessGroup | None, peers: Sequence[int] | None, gone: Sequence[int]
) -> PeerFailureError:
    """The error of a rank that waited on live peers while ranks elsewhere were gone."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    waited = f" on {_ranks(sorted(set(peers) - {rank}), group)}" if peers else ""
    message = (
        f"{operation} failed on rank {rank} of {world_size}: {_gone_cause(gone, group)}. This rank was waiting"
        f"{waited} and learnt it from the other ranks through the process group's store (no transport error here)"
    )
    return PeerFailureError(message, operation=operation, rank=rank, suspects=gone, timed_out=False)


def _out_of_step(operation: str, group: ProcessGroup | None, message: str, suspects: Sequence[int]) -> PeerFailureError:
    """The error of a rank whose wait can never end: the same message on every rank in the crossing."""
    return PeerFailureError(message, operation=operation, rank=dist.get_rank(group), suspects=suspects,
                            timed_out=False)


def _gone_cause(gone: Sequence[int], group: ProcessGroup | None) -> str:
    ranks = _ranks(gone, group)
    if len(gone) == 1:
        return (f"{ranks} is gone: it did not answer the roll call through the process group's store, so its "
                f"process exited or was killed, and its own first error is the cause: look for it in {ranks}'s log")
    return (f"{ranks} are gone: they did not answer the roll call through the process group's store, so their "
            f"processes exited or were killed, and their own first errors are the cause: look in their logs")


def _named(
    error: RuntimeError, operation: str, group: ProcessGroup | None, peers: Sequence[int] | None
) -> PeerFailureError:
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    gone = gone_ranks(group)  # the peer this transfer talked to may be a live one that stopped on the failure
    if gone:
        message = f"{operation} failed on rank {rank} of {world_size}: {_gone_cause(gone, group)}. " \
                  f"Transport error: {first_line}"
        return PeerFailureError(message, operation=operation, rank=rank, suspects=gone, timed_out=False)
    suspects = sorted(set(peers) - {rank}) if peers is not None else [r for r in range(world_size) if r != rank]
    timed_out = bool(_TIMEOUT_WORDS.search(str(error)))
    ranks = _ranks(suspects, group)  # "rank 2" or "ranks [1, 2]"
    if len(suspects) == 1:
        who, its, it_is = ranks, f"{ranks}'s log", "it is"
    else:
        who, its, it_is = f"one of {ranks}", f"the logs of {ranks}", "one of them is"
    if timed_out:
        cause = (
            f"{who} did not take part within the process group's timeout: {it_is} alive but stuck, still in "
            f"other code, or running other collectives. Look at what it does in {its} or in a stack dump "
            "(py-spy dump --pid PID); init_process_group(timeout=...) bounds this wait"
        )
    else:
        cause = (
            f"the connection to {who} was closed: that process most likely exited or crashed, and its own first "
            f"error is the cause: look for it in {its}"
        )
    message = f"{operation} failed on rank {rank} of {world_size}: {cause}. Transport error: {first_line}"
    return PeerFailureError(message, operation=operation, rank=rank, suspects=suspects, timed_out=timed_out)


def _ranks(ranks: Sequence[int], group: ProcessGroup | None) -> str:
    """``rank 2`` / ``ranks [1, 2]``, with global ranks where the group numbers them otherwise (logs use those)."""
    names = [str(r) for r in ranks]
    if group is not None and group is not dist.GroupMember.WORLD:
        names = [_with_global(r, dist.get_global_rank(group, r)) for r in ranks]
    return f"rank {names[0]}" if len(names) == 1 else f"ranks [{', '.join(names)}]"


def _with_global(rank: int, global_rank: int) -> str:
    return str(rank) if rank == global_rank else f"{rank} (global rank {global_rank})"
