"""Lightning DDP on 2 nodes × 2 CPU devices: test_lightning's float64 pair model for 2 epochs; run by two_nodes.py.

    python tests/two_nodes.py lightning tests/lightning_two_nodes_script.py OUT_DIR

Each rank writes what it saw and its final weights to ``OUT_DIR/nodes-rank{r}.json``; the global batch
is test_lightning's, split over the 4 ranks (the last step of an epoch split (1, 0, 0, 0)).
"""

from __future__ import annotations

import sys

from test_lightning import GLOBAL_BATCH, PairModule, trainer

if __name__ == "__main__":
    module = PairModule(sys.argv[1], 0, "nodes", GLOBAL_BATCH // 4)
    trainer(devices=2, num_nodes=2, strategy="ddp", max_epochs=2, enable_checkpointing=False).fit(module)
