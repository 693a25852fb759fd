"""The agreement's errors: every rank raises the same one, which names the rank at fault and what each passed.

Every rank holds the same table after the exchange, so every rank sees the same mismatch and calls
:func:`raise_everywhere` together: one more exchange (on this error path only) shares readable
descriptions of each rank's inputs and options, and every rank raises the same ``ValueError``
(``TypeError`` or ``RuntimeError`` where a rank's own problem was one). What is compared, in order:
the ranks' calls on the group, a rank's own problem, the operation, the options, the scalar values,
the given sizes, the inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from contrastive_dist._validation import Problem
from contrastive_dist.engine._agreement_inputs import describe
from contrastive_dist.engine._agreement_row import Row
from contrastive_dist.engine._faults import naming_peers

__all__ = ["DEBUG_VARIABLE", "raise_everywhere"]

DEBUG_VARIABLE = "CONTRASTIVE_DIST_DEBUG"
"""Environment variable: ``1`` verifies caller-given ``sizes=`` with one extra exchange; ``0`` / unset: off."""

_MODE_HINT = (" A SyncBatchNorm in eval mode makes no exchange: every rank's model must be in the same mode "
              "(model.train() or model.eval() on every rank).")


def raise_everywhere(
    tensors: Sequence[object],
    problem: Problem | None,
    options: Mapping[str, object] | None,
    given: tuple[tuple[int, ...], tuple[int, ...]] | None,
    group: ProcessGroup | None,
    operation: str,
    mismatch: Mapping[str, bool],
    table: Sequence[Row],
    scalar_names: Sequence[str] = (),
) -> None:
    """Every rank calls this together: share readable descriptions, raise the same error.

    ``given``: the ``sizes=`` and ``text_sizes=`` this rank was given (``()`` for one not given), or None.
    """
    described = describe(tensors)
    if mismatch["sizes"]:
        described += ", no sizes=" if given is None else "".join(
            f", {name}={sizes}" for name, sizes in zip(("sizes", "text_sizes"), given, strict=True) if sizes)
    mine = {
        "kind": problem[0].__name__ if problem else "",
        "text": problem[1] if problem else described,
        "options": dict(options or {}),
        "operation": operation,
    }
    gathered: list[Any] = [None] * len(table)
    with naming_peers("agreement (exchange of the error descriptions)", group):
        dist.all_gather_object(gathered, mine, group=group)
    kind, headline, lines = _explained(gathered, table, operation, mismatch, given, scalar_names)
    raise kind(headline + "\n" + "\n".join(lines))


def _explained(
    gathered: list[Any],
    table: Sequence[Row],
    operation: str,
    mismatch: Mapping[str, bool],
    given_sizes: tuple[tuple[int, ...], tuple[int, ...]] | None,
    scalar_names: Sequence[str],
) -> tuple[type[Exception], str, list[str]]:
    failing = [rank for rank, entry in enumerate(gathered) if entry["kind"]]
    lines = [f"  rank {rank}: {'ERROR ' if entry['kind'] else ''}{entry['text']}"
             for rank, entry in enumerate(gathered)]
    operations = [entry["operation"] for entry in gathered]
    if mismatch["calls"]:
        return ValueError, _calls_headline(operation, table), [
            f"  rank {rank}: {operations[rank]}, its call {row.call} on this group" for rank, row in enumerate(table)]
    if failing:
        # A rank found its own input invalid: its message leads, raised with its type everywhere.
        first = gathered[failing[0]]
        kind = {"TypeError": TypeError, "RuntimeError": RuntimeError}.get(first["kind"], ValueError)
        return kind, (f"{operation}: {first['text']} (on rank {failing[0]}; raised on every rank of the group). "
                      "Inputs per rank:"), lines
    if mismatch["options"] and len(set(operations)) > 1:
        hint = _MODE_HINT if any(name.startswith("SyncBatchNorm") for name in operations) else ""
        return ValueError, ("the ranks reached one exchange from different operations; every rank must make the same "
                            f"calls in the same order (a rank with no rows too).{hint}"), [
            f"  rank {rank}: {name}" for rank, name in enumerate(operations)]
    if mismatch["options"]:
        differing = sorted({key for entry in gathered for key in entry["options"]
                            if len({repr(other["options"].get(key)) for other in gathered}) > 1})
        return ValueError, (f"{operation}: the ranks called it with different options ({', '.join(differing)}); they "
                            "must match:"), [
            f"  rank {rank}: " + ", ".join(f"{key}={entry['options'].get(key)!r}" for key in differing)
            for rank, entry in enumerate(gathered)]
    if mismatch["scalars"]:
        differing = [(index, name) for index, name in enumerate(scalar_names)
                     if len({repr(row.scalars[index]) for row in table}) > 1]
        return ValueError, (f"{operation}: the ranks passed different values of "
                            f"{', '.join(name for _, name in differing)}; a parameter the ranks share must hold the "
                            "same value on every rank (a model wrapped in DDP keeps it so):"), [
            f"  rank {rank}: " + ", ".join(f"{name}={row.scalars[index]!r}" for index, name in differing)
            for rank, row in enumerate(table)]
    given = {row.sizes for row in table}
    if mismatch["sizes"] and len(given) == 1 and given_sizes is not None:
        held = (tuple(row.rows for row in table), tuple(row.extra for row in table))
        wrong = [(name, sizes, counts) for name, sizes, counts in zip(("sizes", "text_sizes"), given_sizes, held,
                                                                     strict=True) if sizes and sizes != counts]
        said = " and ".join(f"{name}={sizes} was given, but the ranks hold {counts}" for name, sizes, counts in wrong)
        return ValueError, f"{operation}: {said} rows. Inputs per rank:", lines
    if mismatch["sizes"]:
        why = f" (checked because {DEBUG_VARIABLE}=1)" if operation == "all_gather" else ""
        return ValueError, (f"{operation}: sizes= must be given on every rank or on none, be the same sequence on "
                            f"every rank, and equal each rank's rows{why}. Inputs per rank:"), lines
    return ValueError, (f"{operation}: the ranks' inputs do not agree: the dtype, every dimension except the batch, "
                        "the device type, and whether autograd tracks them must match on all ranks. Inputs per "
                        "rank:"), lines


def _calls_headline(operation: str, table: Sequence[Row]) -> str:
    calls = [row.call for row in table]
    behind = [rank for rank, call in enumerate(calls) if call < max(calls)]
    lag = max(calls) - min(calls)
    who = f"rank {behind[0]}" if len(behind) == 1 else f"ranks {behind}"
    return (f"{operation}: the ranks reached this exchange at different calls on this group: {who} "
            f"{'is' if len(behind) == 1 else 'are'} {lag} call{'s' if lag > 1 else ''} behind. A call that left "
            "before its exchange on one rank (it raised there, and the caller caught the error and went on) pairs "
            "the other ranks' calls with that rank's next ones; every rank must make the same calls in the same "
            "order. The ranks are in step again now: the next call works. Calls per rank:")
