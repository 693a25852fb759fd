"""Several nodes, as on a cluster, on this machine: two torchrun agents (one c10d rendezvous), two Lightning launches.

Each runs as a background command (``tests/background.py``) through ``tests/two_nodes.py``, 2 nodes of 2
processes: the cluster exactness check (DDP and HSDP over nodes × processes, both modes, against one
float64 process), the torchrun CLIP recipe (a few steps and its held-out evaluation), and Lightning DDP
with ``num_nodes=2`` (``NODE_RANK``) training test_lightning's float64 model to the weights of one process.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import background
import pytest
from test_lightning import LENGTH, reference

ROOT = Path(__file__).resolve().parents[1]
TWO_NODES = [sys.executable, str(ROOT / "tests" / "two_nodes.py")]


def _declare(key: str, *argv: str) -> str:
    return background.command(key, [*TWO_NODES, *argv], cwd=ROOT)


EXACTNESS = _declare("exactness on two torchrun nodes", "torchrun", str(ROOT / "recipes" / "exactness_torchrun.py"))
RECIPE = background.command(
    "torchrun recipe on two nodes",
    [*TWO_NODES, "torchrun", str(ROOT / "recipes" / "clip_torchrun.py"), "--train-size", "49", "--batch-size", "6",
     "--max-steps", "3", "--output-dir", "run"],
    cwd=background.workspace("torchrun recipe on two nodes"))  # fmt: skip
LIGHTNING = _declare("lightning on two nodes", "lightning", str(ROOT / "tests" / "lightning_two_nodes_script.py"),
                     str(background.workspace("lightning on two nodes")))


def _finished(key: str) -> str:
    done = background.outcome(key, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.timeout(960)
@pytest.mark.background(EXACTNESS)
def test_the_exactness_check_passes_on_two_torchrun_nodes() -> None:
    line = re.search(r"exactness on 4 processes \(2 node\(s\) × 2\).*", _finished(EXACTNESS))
    assert line is not None
    errors = re.findall(r"(DDP|HSDP) (gather|ring) (\S+?)[,:]", line.group(0))
    assert len(errors) == 4 and all(float(error) <= 1e-10 for *_, error in errors), line.group(0)


@pytest.mark.timeout(960)
@pytest.mark.background(RECIPE)
def test_the_torchrun_recipe_trains_on_two_torchrun_nodes() -> None:
    output = _finished(RECIPE)
    assert "held-out recall over 64 pairs" in output and "3 steps in" in output
    assert (background.workspace(RECIPE) / "run" / "checkpoint.pt").is_file()


@pytest.mark.timeout(960)
@pytest.mark.background(LIGHTNING)
def test_lightning_on_two_nodes_trains_to_the_weights_of_one_process() -> None:
    _finished(LIGHTNING)
    folder = background.workspace(LIGHTNING)
    records = [json.loads(path.read_text()) for path in sorted(folder.glob("nodes-rank*.json"))]
    assert len(records) == 4
    orders, weights = reference(2)
    for epoch in range(2):
        steps = [[ids for entry_epoch, _, ids, _ in record["seen"] if entry_epoch == epoch] for record in records]
        assert [index for step in zip(*steps) for ids in step for index in ids] == orders[epoch]
        assert sorted(orders[epoch]) == list(range(LENGTH))
    expected = [value for tensor in weights for value in tensor]
    for record in records:
        assert [value for tensor in record["weights"] for value in tensor] == pytest.approx(expected, rel=1e-10)
