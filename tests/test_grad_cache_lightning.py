"""grad_cache in a LightningModule's training_step: Lightning DDP, 2 CPU processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from forked_runs import forked_runs

pytest.importorskip("lightning")
SCRIPT = Path(__file__).resolve().parent / "grad_cache_lightning_script.py"


@pytest.mark.timeout(300)
def test_lightning_ddp_with_accumulation_trains_to_the_weights_of_the_memory_hungry_reference(tmp_path: Path) -> None:
    for mode in ("cached", "reference"):  # ranks forked from a fork of tests/forked_runs.py's server
        result = forked_runs().script([str(SCRIPT), mode, str(tmp_path), "ddp_fork"], cwd=tmp_path, timeout=140,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    weights = {(mode, rank): torch.load(tmp_path / f"{mode}-rank{rank}.pt", weights_only=True)
               for mode in ("cached", "reference") for rank in (0, 1)}
    initial = weights["cached", 0]["log_scale"].new_tensor(4.0).log()
    assert not torch.allclose(weights["cached", 0]["log_scale"], initial)  # it trained
    for (mode, rank), state in weights.items():
        for name, value in weights["reference", 0].items():
            torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-10, msg=f"{mode} rank {rank} {name}")
