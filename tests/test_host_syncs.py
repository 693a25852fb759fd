"""A loss call on an accelerator waits for the device at most once: the agreement's exchange itself.

Counted on CPU with stand-in device tensors (``tests/host_syncs.py``): one process, where nothing
is exchanged and nothing is read (device labels stay integers, undecided), and 2 gloo processes,
where the agreement's table is read once. Forward and backward, both modes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from contrastive_dist import info_nce, nt_xent, siglip, supcon
from contrastive_dist.engine._agreement import agree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_syncs import DEVICE, counting_host_syncs  # noqa: E402

Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]
# Each loss with its options given as numbers (the values the host already has) and as tensors.
CALLS: dict[str, Call] = {
    "info_nce temperature": lambda a, b, labels, options: info_nce(a, b, temperature=0.1, **options),
    "info_nce logit_scale": lambda a, b, labels, options: info_nce(a, b, a.new_full((), 10.0), **options),
    "siglip numbers": lambda a, b, labels, options: siglip(a, b, 10.0, -10.0, **options),
    "siglip tensors": lambda a, b, labels, options: siglip(a, b, a.new_full((), 10.0), a.new_full((), -10.0),
                                                           **options),
    "nt_xent": lambda a, b, labels, options: nt_xent(a, b, temperature=0.5, **options),
    "supcon": lambda a, b, labels, options: supcon(a, labels, temperature=0.5, **options),
}
# With one process no call reads the device: not even SupCon's labels (whether they are small integers
# is decided only where the flag travels in the agreement's exchange).
ONE_PROCESS = dict.fromkeys(CALLS, 0)
ON_RANKS = ("info_nce temperature", "siglip numbers", "supcon")  # numbers, a bias, labels: each kind of option


def _syncs_of_calls(rows: int, seed: int, names: Sequence[str], group: Any = None) -> dict[str, list[str]]:
    """The calls ``names`` of ``CALLS`` in both modes on stand-in device tensors: each one's syncs, forward and
    backward."""
    found = {}
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        call = CALLS[name]
        for mode in ("gather", "ring"):
            values = torch.randn(2, rows, 8, generator=generator)
            labels = torch.randint(0, 3, (rows,), generator=generator)
            with counting_host_syncs() as counter:
                a, b = (values[index].to(DEVICE, non_blocking=True).requires_grad_() for index in range(2))
                on_device = labels.to(DEVICE, non_blocking=True)
                counter.syncs.clear()  # the inputs' copies belong to the caller
                call(a, b, on_device, {"communication": mode, "group": group}).backward()
                assert a.grad is not None
            found[f"{name} {mode}"] = counter.syncs
    return found


def test_the_counter_sees_what_stalls_the_host() -> None:
    with counting_host_syncs() as counter:
        on_device = torch.full((3,), 2.0, device=DEVICE)  # filled there: no sync
        pinned = torch.empty(3, pin_memory=True)
        pinned.to(DEVICE, non_blocking=True)  # from pinned memory, not waited for: no sync
        assert counter.syncs == []
        float(on_device.sum())
        on_device.tolist()
        torch.tensor(1.0, device=DEVICE)
        torch.ones(3).to(DEVICE)
        on_device[on_device > 1]
        on_device.cpu()
    assert counter.syncs == ["item", "tolist", "torch.tensor(..., device=the device)",
                             "blocking or pageable copy to the device", "aten::index with a mask",
                             "copy to the host"]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_one_process_loss_calls_make_no_sync_beyond_a_labels_flag(name: str) -> None:
    found = _syncs_of_calls(6, 0, [name])
    assert found == {f"{name} {mode}": ["item"] * ONE_PROCESS[name] for mode in ("gather", "ring")}, found


def _group() -> Any:
    """The ranks' group, with gloo serving the stand-in device too (the ring's point-to-point asks for it)."""
    return dist.new_group(list(range(dist.get_world_size())), backend=f"cpu:gloo,{DEVICE.type}:gloo")


def loss_calls_on_ranks(rank: int, world_size: int) -> dict[str, list[str]]:
    """The calls ``ON_RANKS`` on uneven shards (rank 1 empty) of stand-in device tensors."""
    return _syncs_of_calls(0 if rank == 1 else 3 + 2 * rank, rank, ON_RANKS, group=_group())


def agreement_with_total(rank: int, world_size: int) -> tuple[list[str], float]:
    """The agreement alone, with a weight total and a device flag: its syncs and the agreed total."""
    with counting_host_syncs() as counter:
        features = torch.full((rank + 1, 4), 1.0, device=DEVICE)
        total = torch.full((), 0.5 + rank, device=DEVICE)
        flag = torch.ones((), dtype=torch.int64, device=DEVICE)
        layout = agree((features,), problem=None, group=_group(), operation="test", total=total, flags=flag)
        syncs = list(counter.syncs)
        assert layout.total is not None and layout.every_rank_has(1)
        agreed = float(layout.total.inner)  # type: ignore[attr-defined]
    return syncs, agreed


def test_two_ranks_one_sync_per_loss_call_the_agreement_exchange(pool: Any) -> None:
    for syncs in pool(2).run(loss_calls_on_ranks, timeout=240):
        assert syncs == {f"{name} {mode}": ["tolist"] for name in ON_RANKS for mode in ("gather", "ring")}, syncs


def test_two_ranks_the_agreement_carries_a_device_total_and_flag_without_reading_them(pool: Any) -> None:
    assert pool(2).run(agreement_with_total, timeout=120) == [(["tolist"], 2.0)] * 2
