"""A rank killed mid-epoch (SIGKILL) leaves no process of the run behind: workers, forkservers, the other rank.

Two gloo ranks each iterate a ``streaming_loader`` (webdataset shards) and a ``distributed_loader``
(map-style, persistent workers) side by side, 2 ``forkserver`` DataLoader workers each: 8 workers
and 2 forkservers. Each worker writes its pid, its parent's (the forkserver) and their start times
through a test-side ``worker_init_fn``, which the package wraps. Mid-epoch the test kills rank 1
with SIGKILL; rank 0's next exchange fails and it exits. Every one of those processes must be gone
within seconds (a pid counts as alive while ``/proc`` shows it with the start time it had, not a
zombie). Before, the workers of a killed rank and its forkserver waited for each other forever.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from contrastive_dist.lightning import distributed_loader, streaming_loader

wds = pytest.importorskip("webdataset")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads processes from /proc")

WORLD, WORKERS = 2, 2


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


class RecordPids:
    """A ``worker_init_fn`` that writes the worker's pid and its parent's (the forkserver) with their start times."""

    def __init__(self, directory: str, loader: str) -> None:
        self.directory, self.loader = directory, loader

    def __call__(self, worker_id: int) -> None:
        pids = {pid: start_time(pid) for pid in (os.getpid(), os.getppid())}
        Path(self.directory, f"worker-{os.getpid()}.json").write_text(json.dumps(pids))


def to_pair(sample: dict) -> tuple[torch.Tensor, int]:
    return torch.tensor([float(sample["cls"])]), sample["cls"]


def rank_main(rank: int, store_path: str, directory: str, shards: list[str]) -> None:
    torch.set_num_threads(1)
    torch_mp.set_forkserver_preload(["torch", "webdataset", "contrastive_dist", __name__])
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=20))
    stream = streaming_loader(shards, None, wds.tarfile_to_samples(), wds.decode(), wds.map(to_pair), batch_size=2,
                              example=(torch.zeros(1), 0), num_workers=WORKERS,
                              worker_init_fn=RecordPids(directory, "streaming_loader"))
    mapped = distributed_loader(list(range(4000)), None, batch_size=2, num_workers=WORKERS,
                                multiprocessing_context="forkserver",
                                worker_init_fn=RecordPids(directory, "distributed_loader"))
    for step, _ in enumerate(zip(stream, mapped)):
        if step == 3:
            Path(directory, f"rank{rank}.json").write_text(json.dumps({os.getpid(): start_time(os.getpid())}))
        time.sleep(0.05)
    raise AssertionError("the epoch ended before the test killed a rank")


def test_a_rank_killed_mid_epoch_leaves_no_worker_forkserver_or_rank_behind(tmp_path: Path) -> None:
    shards = []
    for index in range(4):
        path = tmp_path / f"part-{index}.tar"
        with wds.TarWriter(str(path)) as writer:
            for sample in range(500):
                writer.write({"__key__": f"s{index}-{sample:05d}", "cls": index * 1000 + sample})
        shards.append(str(path))
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=rank_main, args=(rank, str(tmp_path / "store"), str(tmp_path), shards))
             for rank in range(WORLD)]
    for process in ranks:
        process.start()
    recorded: dict[int, int | None] = {}
    try:
        deadline = time.monotonic() + 240
        while (len(list(tmp_path.glob("rank*.json"))) < WORLD
               or len(list(tmp_path.glob("worker-*.json"))) < 2 * WORLD * WORKERS):
            assert time.monotonic() < deadline, "the ranks did not start their workers within 240 s"
            assert all(process.is_alive() for process in ranks), "a rank ended before the test killed one"
            time.sleep(0.2)
        for path in [*tmp_path.glob("rank*.json"), *tmp_path.glob("worker-*.json")]:
            recorded.update({int(pid): started for pid, started in json.loads(path.read_text()).items()})
        forkservers = {pid for pid in recorded if pid not in {process.pid for process in ranks}} - {
            int(path.stem.split("-")[1]) for path in tmp_path.glob("worker-*.json")}
        assert len(forkservers) == WORLD and len(recorded) == WORLD * (1 + 2 * WORKERS) + WORLD, recorded
        assert all(start_time(pid) == started for pid, started in recorded.items())  # all running when killed

        os.kill(ranks[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        left = set(recorded)
        while left and time.monotonic() - killed_at < 30:
            for process in ranks:
                process.join(timeout=0)  # reaps an exited rank, so that it is no zombie of ours
            left = {pid for pid, started in recorded.items() if start_time(pid) == started}
            time.sleep(0.1)
        seconds = time.monotonic() - killed_at
        print(f"\nall {len(recorded)} processes of the run gone {seconds:.1f} s after SIGKILL of rank 1")
        assert not left, f"still running {seconds:.0f} s after rank 1 was killed: {sorted(left)}"
        assert ranks[0].exitcode not in (None, 0, -signal.SIGKILL)  # rank 0 ended on its own, with an error
    finally:
        for pid, started in recorded.items():
            if start_time(pid) == started:
                os.kill(pid, signal.SIGKILL)
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
