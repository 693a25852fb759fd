"""sentence-transformers' own trainer with the drop-ins on 2 gloo processes equals one process, step by step.

``tests/st_trainer_script.py`` runs ``SentenceTransformerTrainer`` (DDP with ``find_unused_parameters=True``,
a BERT whose pooler is unused) with the plain and the cached drop-in, with and without a hard-negative
column, and ``MatryoshkaLoss`` around the cached one, on steps split [4, 4] and [4, 2], once under
``torchrun`` on 2 processes and once on 1 process. The gradients the optimizer steps with (DDP's
average, clipped as the trainer clips) equal the one process's (float32, ≤ 1e-5 relative), and the
trainer logs the same losses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sentence_transformers")
pytest.importorskip("datasets")

from st_trainer_script import CASES  # noqa: E402
from tiny_bert import save_tiny_bert  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "st_trainer_script.py"


def _run(command: list[str], tmp_path: Path) -> None:
    root = SCRIPT.parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(root), str(SCRIPT.parent)])}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.mark.timeout(900)
def test_trainer_on_two_processes_steps_as_one_process(tmp_path: Path) -> None:
    model = save_tiny_bert(tmp_path / "model")
    arguments = [str(SCRIPT), str(model), str(tmp_path)]
    _run([sys.executable, *arguments], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *arguments], tmp_path)
    for kind, negatives in CASES:
        single = torch.load(tmp_path / f"{kind}-{negatives}-w1-rank0.pt")
        ranks = [torch.load(tmp_path / f"{kind}-{negatives}-w2-rank{rank}.pt") for rank in (0, 1)]
        assert len(single["grads"]) == 2 and len(single["losses"]) == 2, kind
        expected_class = {"mnrl": "MultipleNegativesRankingLoss", "cached": "CachedMultipleNegativesRankingLoss",
                          "matryoshka": "MatryoshkaLoss"}[kind]
        assert single["class"] == expected_class, single["class"]
        for rank, result in enumerate(ranks):
            what = f"{kind} negatives={negatives} rank {rank}"
            for step, expected in enumerate(single["grads"]):
                grads = result["grads"][step]
                assert grads.keys() == expected.keys() and not any("pooler" in name for name in grads), what
                flat = torch.cat([grads[name].flatten() for name in expected])
                reference = torch.cat([value.flatten() for value in expected.values()])
                error = float((flat - reference).norm() / reference.norm())
                assert error <= 1e-5, f"{what} step {step}: {error:.2e} relative"
            assert result["losses"] == pytest.approx(single["losses"], rel=1e-5), what
