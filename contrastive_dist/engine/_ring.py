"""Point-to-point transport of the ring mode: blocks travel round the ring, one hop per step.

Rank ``r`` sends to ``r − 1`` and receives from ``r + 1`` (ranks of ``group``), so at step ``k``
it holds the block of rank ``(r + k) mod W``; after ``W − 1`` hops it has seen every block.

:func:`circulate` runs one pass and, optionally, an **accumulator** per block that collects
every rank's contribution and comes home to the block's owner: the owner starts it, it follows
its block one hop behind and each rank adds into it in place, so a step holds one accumulator
whatever ``W`` (``W`` hops; the block itself needs ``W − 1``).

What makes it safe and fast (each point a hang or a stall seen otherwise):

* every send and receive of a step is posted in one ``batch_isend_irecv`` *before* computing on
  the current block, so the next block is on its way while this one is used (overlap), and
  NCCL, whose sends block until matched, sees all of a step's operations as one group; a step's
  contribution to the travelling accumulator is computed into a fresh one and merged in after
  the accumulator has arrived, so that its transfer overlaps the compute too (one accumulator
  more in memory);
* each message gets a fresh buffer and every operation is waited on before its buffer is
  reused or returned;
* sizes are known to every rank up front, so an empty block (a rank with no rows) is skipped
  on both ends of a link identically; an empty rank still forwards what passes through it;
* messages between two ranks are posted in the same order on both ends (NCCL matches by order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist.engine._faults import naming_peers, wait_named
from contrastive_dist.engine._progress import begin_operation

__all__ = ["Ring", "circulate"]

Block = tuple[Tensor, ...]


class _Pending:
    """The works of one ``batch_isend_irecv``; :meth:`wait` before touching their buffers.

    ``peers`` holds, per work, the rank it talks to and which way, so that a failed wait names it.
    """

    def __init__(
        self, works: list[dist.Work], buffers: Sequence[Tensor], peers: list[tuple[int, str]], ring: Ring, step: str
    ) -> None:
        self._works = works
        self._buffers = buffers  # alive until waited on, whatever the caller drops
        self._peers, self._ring, self._step = peers, ring, step

    def wait(self) -> None:
        begin_operation(self._ring.group, self._step)  # one collective of the group, however many transfers
        # One work per operation (gloo); a backend that coalesces the batch returns fewer: both neighbours.
        per_work = len(self._peers) == len(self._works)
        sliced = all(buffer.device.type == "cpu" for buffer in self._buffers)
        for index, work in enumerate(self._works):
            peer, way = self._peers[index] if per_work else (None, "")
            peers = (peer,) if peer is not None else self._ring.neighbours()
            wait_named(work, f"{self._step}{way}", self._ring.group, peers=peers, sliced=sliced, point_to_point=True)
        self._works, self._buffers = [], ()


@dataclass(frozen=True)
class Ring:
    """One rank's place in the ring of ``group``: who it sends to and receives from.

    Attributes:
        rank: this process's rank in ``group``.
        world_size: the number of ranks ``W``.
        sizes: every rank's number of rows ``n_r`` (known to all: empty blocks are skipped on both ends).
        group: the process group (``None``: the world).
    """

    rank: int
    world_size: int
    sizes: tuple[int, ...]
    group: ProcessGroup | None = None

    def owner(self, step: int) -> int:
        """The rank whose block this rank holds at ``step``."""
        return (self.rank + step) % self.world_size

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def neighbours(self) -> tuple[int, int]:
        """The previous rank (this one sends to it) and the next (this one receives from it)."""
        return (self.rank - 1) % self.world_size, (self.rank + 1) % self.world_size

    def shift(
        self, outgoing: Sequence[Tensor], incoming: Sequence[Tensor], *, step: str = "ring step"
    ) -> _Pending | _TracedPending:
        """Post sends of ``outgoing`` to the previous rank and receives into ``incoming`` from the next.

        Empty tensors are skipped (the other end, knowing the sizes, skips them too). Tags number
        the messages of one call so that gloo matches them like NCCL does, by order. ``step`` names
        the hop in the error raised when a neighbour vanished.
        """
        previous, following = self.neighbours()
        if torch.compiler.is_compiling():
            return _traced_shift(self, outgoing, incoming)
        ops, peers = [], []
        for kind, tensors, peer, way in (
            (dist.isend, outgoing, previous, f" (sending to rank {previous})"),
            (dist.irecv, incoming, following, f" (receiving from rank {following})"),
        ):
            for tag, tensor in enumerate(tensors):
                if tensor.numel():
                    ops.append(dist.P2POp(kind, tensor, self._global(peer), self.group, tag))
                    peers.append((peer, way))
        with naming_peers(step, self.group, peers=self.neighbours()):
            works = dist.batch_isend_irecv(ops) if ops else []
        return _Pending(works, (*outgoing, *incoming), peers, self, step)


class _TracedPending:
    """Under ``torch.compile``: the received blocks, copied into their buffers on :meth:`wait`, and the sends waited.

    Each send is waited once, on the tensor sent, as eager mode waits it before its buffer is reused. The
    compiled graph's memory planning reuses a buffer after its last use, and a send's last use would
    otherwise be the point-to-point op itself: a later kernel could then overwrite a block that gloo has
    not yet sent. The wait is a use of the sent tensor, so its memory stays untouched until the send is
    done. It is waited on the tensor, never on the op's empty placeholder for the send: the same gloo send
    is registered on both, every wait on a tensor waits what is registered on its memory, and a gloo send
    waited twice never completes.
    """

    def __init__(self, received: list[tuple[Tensor, Tensor]], sent: list[Tensor]) -> None:
        self._received, self._sent = received, sent

    def wait(self) -> None:
        import torch.distributed._functional_collectives as funcol

        for buffer, block in self._received:
            buffer.copy_(block)
        for tensor in self._sent:
            funcol.wait_tensor(tensor)
        self._received, self._sent = [], []


def _order_traced_hops() -> None:
    """Mark the functional point-to-point op an ordered effect, so that a compiled graph keeps its hops in order.

    Without it the op is only kept from dead-code elimination, and AOTAutograd's partitioner places each hop
    by its data alone: a backward hop that needs no upstream gradient (a block's features) is computed in
    the forward graph, and may be computed again in the backward (recomputed, not saved), one that does (a
    gradient accumulator) stays in the backward, and on a rank without rows in a direction, whose upstream
    gradient is zeros made there (``torch.cat`` drops an empty input's), the accumulators' hops move into
    the forward too. Ranks with empty blocks then posted the same hops in different orders, or some twice,
    and their messages crossed (3 gloo ranks, images (4, 0, 3), texts (5, 6, 0): 240 bytes arrived where
    192 were expected; square SigLIP, (3, 0, 2): 144 where 96). An ordered effect threads a token through
    the hops, and is never recomputed: the forward's hops stay in the forward graph and the backward's in
    the backward, each once, in the order traced, the eager order, on every rank. Done once, at import
    (registering is not traceable), for the op process-wide: any compiled use of it keeps its order, which a
    point-to-point exchange needs anyway. A torch without the op or its registry is left as it is.
    """
    try:
        from torch._higher_order_ops import effects

        op = torch.ops._c10d_functional.batch_p2p_ops.default
        # (Older torch keeps the registry in a dict.)
        get_effect = getattr(effects, "_get_effect", None) or getattr(effects, "SIDE_EFFECTS", {}).get
        if get_effect(op) is None:
            effects._register_effectful_op(op, effects._EffectType.ORDERED)
    except (ImportError, AttributeError, RuntimeError):
        return


_order_traced_hops()


def _traced_shift(ring: Ring, outgoing: Sequence[Tensor], incoming: Sequence[Tensor]) -> _TracedPending:
    """The same hop through the functional point-to-point op, which dynamo traces as it is.

    ``dist.P2POp`` and ``dist.batch_isend_irecv`` trace only with dynamo's experimental
    ``enable_p2p_compilation`` (``TORCHDYNAMO_ENABLE_P2P_COMPILATION=1``); the op they are traced
    into needs no flag, so ring mode compiles without one. Peers are ranks of the group here.
    """
    import torch.distributed._functional_collectives as funcol

    previous, following = ring.neighbours()
    # A block is received into a fresh buffer, then copied into the caller's on wait: the op's schema does
    # not say that it writes its receive buffers, so the compiler may merge two identical ones (two
    # accumulators initialised alike) into one, or reuse the memory of one that a later step still reads,
    # while the message is being written into it. A fresh ``empty`` is never merged with another.
    # A block to send is first passed through a wait, which finds no transfer of its own to wait for: it
    # makes the compiler materialise the block as one buffer, which the op then sends and ``wait`` waits.
    # A block not yet materialised (an accumulator fused into the kernel computing it) would otherwise be
    # copied into a buffer of the op's own, and ``wait`` would keep a second copy alive, not the buffer
    # that gloo is sending.
    posted = [
        (name, peer, tag, tensor, funcol.wait_tensor(tensor) if name == "isend" else torch.empty(
            tensor.shape, dtype=tensor.dtype, device=tensor.device))
        for name, blocks, peer in (("isend", outgoing, previous), ("irecv", incoming, following))
        for tag, tensor in enumerate(blocks)
        if tensor.numel()
    ]
    if not posted:
        return _TracedPending([], [])
    group = ring.group if ring.group is not None else dist.group.WORLD
    names, peers, tags, buffers, tensors = (list(column) for column in zip(*posted, strict=True))
    results = funcol.batch_p2p_ops_inplace(names, peers, tags, tensors, group.group_name)  # type: ignore[union-attr]
    # A receive's result is already waited on under tracing; the sends are waited in ``wait``.
    received = [(buffer, result) for name, buffer, result in zip(names, buffers, results, strict=True)
                if name == "irecv"]
    sent = [tensor for name, tensor in zip(names, tensors, strict=True) if name == "isend"]
    return _TracedPending(received, sent)


def circulate(
    ring: Ring,
    own_block: Block,
    new_block: Callable[[int], Block],
    visit: Callable[[int, Block, Tensor | None], None],
    *,
    new_accumulator: Callable[[int], Tensor] | None = None,
    merge_: Callable[[Tensor, Tensor], object] = torch.Tensor.add_,
) -> Tensor | None:
    """Pass every rank's block round the ring and call ``visit(owner, block, accumulator)`` on each.

    Args:
        ring: this rank's place in the ring.
        own_block: this rank's travelling tensors (contiguous); visited first.
        new_block: ``new_block(owner)`` allocates receive buffers shaped like ``owner``'s block.
        visit: computes on one block and adds this rank's contribution into ``accumulator``, in
            place (``None`` when no accumulator travels).
        new_accumulator: ``new_accumulator(owner)`` returns ``owner``'s accumulator, initialised
            (zeros for a sum, ``-inf`` for a log-sum-exp); ``None``: no accumulator travels.
        merge_: ``merge_(accumulator, part)`` adds a step's contribution, computed into a fresh
            accumulator while the travelling one is on its way, into it (a sum: ``add_``).

    Returns:
        The accumulator of this rank's own block, with every rank's contribution (``None``
        without accumulator).
    """
    block, accumulator = own_block, None
    incoming: Tensor | None = None
    accumulator_transfer: _Pending | _TracedPending | None = None
    for step in range(ring.world_size):
        last = step == ring.world_size - 1
        hop = f"ring step {step + 1} of {ring.world_size}"
        if not last:
            # The next block is on its way while this one is used.
            next_block = new_block(ring.owner(step + 1))
            block_transfer = ring.shift(block, next_block, step=hop)
        traced = torch.compiler.is_compiling()  # a traced hop is waited on where it is posted: no overlap
        if new_accumulator is not None:
            # The owner starts its block's accumulator; later steps compute into a fresh part while
            # the travelling accumulator is still on its way, then merge it in.
            if accumulator_transfer is not None and traced:
                accumulator_transfer.wait()
                accumulator, accumulator_transfer = incoming, None
            else:
                accumulator = new_accumulator(ring.owner(step))
        visit(ring.owner(step), block, accumulator)
        if accumulator_transfer is not None:
            accumulator_transfer.wait()
            merge_(incoming, accumulator)  # type: ignore[arg-type]
            accumulator = incoming
        if accumulator is not None and ring.world_size > 1:
            # It follows its block one hop behind; after the last step it reaches the owner.
            incoming = new_accumulator(ring.owner(step + 1))  # type: ignore[misc]
            accumulator_transfer = ring.shift((accumulator,), (incoming,), step=f"{hop}, accumulator")
            accumulator = None  # only the transfer holds it now
        if not last:
            block_transfer.wait()
            block = next_block
    if accumulator_transfer is None:  # one rank, or no accumulator
        return accumulator
    accumulator_transfer.wait()
    return incoming
