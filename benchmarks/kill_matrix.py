"""Kill one rank of a training step and see what every other rank raises, and when.

Each case starts ``W`` gloo processes (one of them empty), runs a warm-up step of ``info_nce``,
then kills the *victim* during the second step, and records on every survivor the error it raised
(its type, ``suspects``, message) and when, against the moment the victim died. A case passes when
every survivor raised a :class:`~contrastive_dist.PeerFailureError` whose suspects include the
victim, within :data:`BOUND_S` seconds of the death. The process group's timeout is 60 s, so a rank
that waits it out fails clearly.

The grid: communication (``gather``, ``ring``) × how it dies (``exit``: ``os._exit``; ``sigkill``)
× where (``before_forward``; ``before_backward``, between the forward and the backward;
``in_transport``, inside its second ring hop or its second gather transfer) × ``W`` = 2-5 × every
victim × whether the survivors stay alive after their error (until every survivor has raised, at
most 10 s: a neighbour of the dead rank that logs or checkpoints) or exit at once::

    python benchmarks/kill_matrix.py           # the full grid (a few hundred cases, ~20 min on 2 cores)
    python benchmarks/kill_matrix.py --quick   # the representative subset the tests run

The store is a ``TCPStore`` hosted by this process, as ``torchrun``'s agent hosts it.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

BOUND_S = 5.0
"""Every survivor must raise within this many seconds of the death."""
PROCESS_GROUP_TIMEOUT_S = 60.0
SIZES = {2: (3, 0), 3: (2, 0, 3), 4: (2, 3, 0, 1), 5: (1, 2, 0, 3, 2)}
"""Rows per rank: every layout has an empty rank."""
STAY_ALIVE_S = 10.0


class Case(NamedTuple):
    """One kill: where, how, on how many ranks, and whether the survivors stay alive after their error."""

    mode: str
    kill: str
    point: str
    world_size: int
    victim: int
    stay_alive: bool


QUICK = (
    Case("ring", "sigkill", "in_transport", 4, 0, True),
    Case("gather", "exit", "before_backward", 4, 0, True),
    Case("gather", "sigkill", "before_forward", 5, 2, True),
    Case("ring", "exit", "before_forward", 5, 3, True),
    Case("gather", "sigkill", "in_transport", 4, 1, False),
    Case("ring", "exit", "before_backward", 2, 1, False),
)
"""The representative subset: both modes, both kills, every point, distant ranks, survivors alive."""


def full_grid() -> list[Case]:
    """Every case of the grid."""
    cases = []
    for mode, kill, point, world_size, stay_alive in itertools.product(
        ("gather", "ring"), ("exit", "sigkill"), ("before_forward", "before_backward", "in_transport"),
        (2, 3, 4, 5), (True, False),
    ):
        cases += [Case(mode, kill, point, world_size, victim, stay_alive) for victim in range(world_size)]
    return cases


def _die(case: Case, out_dir: str, rank: int) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"died_at": time.time()}))
    if case.kill == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(17)


def _kill_inside_transport(case: Case, out_dir: str, rank: int) -> None:
    """Make the victim die at its second transfer of the step: a ring hop, or a gather's broadcast."""
    from contrastive_dist.engine import _ring, _wire

    module = _ring if case.mode == "ring" else _wire
    original, calls = module.wait_named, [0]

    def dying(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            _die(case, out_dir, rank)
        original(*args, **kwargs)

    module.wait_named = dying  # type: ignore[assignment]


def _rank_main(rank: int, case: Case, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from contrastive_dist import info_nce

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, case.world_size, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=case.world_size,
                            timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    rows = SIZES[case.world_size][rank]
    torch.manual_seed(rank)
    image, text = (torch.randn(rows, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    info_nce(image, text, communication=case.mode).backward()  # warm-up: a step of a running job
    victim = rank == case.victim
    entry: dict[str, object] = {}
    try:
        if victim and case.point == "before_forward":
            _die(case, out_dir, rank)
        if victim and case.point == "in_transport":
            _kill_inside_transport(case, out_dir, rank)
        loss = info_nce(image, text, communication=case.mode)
        if victim and case.point == "before_backward":
            _die(case, out_dir, rank)
        loss.backward()
        entry = {"error": None}
    except Exception as error:  # noqa: BLE001 - recorded, whatever it is
        entry = {"error": type(error).__name__, "message": str(error),
                 "suspects": list(getattr(error, "suspects", ())), "timed_out": getattr(error, "timed_out", None)}
    entry["raised_at"] = time.time()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(entry))
    if case.stay_alive:  # like a rank that logs or checkpoints: alive until every survivor has raised
        deadline = time.monotonic() + STAY_ALIVE_S
        while time.monotonic() < deadline and len(list(Path(out_dir).glob("rank*.json"))) < case.world_size:
            time.sleep(0.05)
    os._exit(0)


def _context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "contrastive_dist"])
    return context


def run_case(case: Case, *, limit_s: float = 90.0) -> dict[str, Any]:
    """Run one case; what every survivor raised, the delays after the death, and whether it passes."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, case.world_size + 1, True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="kill_matrix_") as out_dir:
        context = _context()
        processes = [context.Process(target=_rank_main, args=(rank, case, store.port, out_dir))
                     for rank in range(case.world_size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + limit_s
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        records = {}
        for rank in range(case.world_size):
            path = Path(out_dir, f"rank{rank}.json")
            records[rank] = json.loads(path.read_text()) if path.exists() else {}
    del store
    return _judge(case, records, hung)


def _judge(case: Case, records: dict[int, dict[str, Any]], hung: list[int]) -> dict[str, Any]:
    died_at = records[case.victim].get("died_at")
    survivors = {rank: record for rank, record in records.items() if rank != case.victim}
    delays = [record["raised_at"] - died_at for record in survivors.values()
              if died_at is not None and "raised_at" in record]
    named = all(record.get("error") == "PeerFailureError" and case.victim in record.get("suspects", ())
                for record in survivors.values())
    only = sum(record.get("suspects") == [case.victim] for record in survivors.values())
    passed = bool(not hung and died_at is not None and named and len(delays) == len(survivors)
                  and max(delays, default=0.0) < BOUND_S)
    return {"case": case._asdict(), "passed": passed, "hung": hung, "survivors": len(survivors),
            "victim_only": only, "max_delay_s": max(delays, default=None), "records": records}


def main() -> None:
    """Run the grid (or the quick subset) and print the counts."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the representative subset")
    parser.add_argument("--json", type=Path, help="write every case's outcome here")
    args = parser.parse_args()
    cases = list(QUICK) if args.quick else full_grid()
    outcomes, start = [], time.monotonic()
    for index, case in enumerate(cases):
        outcome = run_case(case)
        outcomes.append(outcome)
        print(f"{index + 1}/{len(cases)} {'ok ' if outcome['passed'] else 'BAD'} {tuple(case)} "
              f"max delay {outcome['max_delay_s']} only-victim {outcome['victim_only']}/{outcome['survivors']}",
              flush=True)
        if not outcome["passed"]:
            print(json.dumps(outcome["records"], indent=1)[:3000], flush=True)
    survivors = sum(outcome["survivors"] for outcome in outcomes)
    only = sum(outcome["victim_only"] for outcome in outcomes)
    delays = [outcome["max_delay_s"] for outcome in outcomes if outcome["max_delay_s"] is not None]
    print(f"cases {len(outcomes)}, passed {sum(outcome['passed'] for outcome in outcomes)}; survivors {survivors}, "
          f"victim the only suspect on {only} ({100 * only / max(survivors, 1):.1f} %); time to raise after the "
          f"death: max {max(delays, default=0.0):.2f} s; wall {time.monotonic() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(outcomes, indent=1))


if __name__ == "__main__":
    main()
