"""Start ranks that write what they saw to ``rank{r}.json``; wait for them, bounded; read it back."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as torch_mp


def launch_ranks(
    rank_main: Callable[..., None], args: tuple[Any, ...], world_size: int, out_dir: Path, timeout: float
) -> list[dict]:
    """Run ``rank_main(rank, *args)`` on ``world_size`` spawned processes; every rank's ``rank{r}.json``.

    A rank that is still running after ``timeout`` seconds is killed and the call raises ``TimeoutError``.
    """
    context = torch_mp.start_processes(_run_then_exit, args=(rank_main, *args), nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world_size} ranks did not finish within {timeout} s (hang?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _run_then_exit(rank: int, rank_main: Callable[..., None], *args: Any) -> None:
    """``rank_main`` on this rank; once it returned, leave without finalizing the interpreter.

    The ranks end with torch's own collectives (``all_gather_object``, ``barrier``), whose gloo worker
    threads may still hold their tensors when the interpreter finalizes: the process then aborts after
    all its work ("terminate called without an active exception"; the package's own collectives wait
    for gloo to let go, ``engine/_settle.py``, torch's do not). What a rank saw is on disk by then.
    """
    rank_main(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
