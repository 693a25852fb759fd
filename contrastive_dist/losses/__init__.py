"""Contrastive losses that follow the gradient contract: each loss defined once, over either transport.

A loss is a function of this rank's rows against every rank's columns, met block by block:

* ``infonce.py``, ``ntxent.py``, ``siglip.py``, ``supcon.py``, ``dcl.py``, ``hcl.py`` — each loss, in one
  file: its own checks and options, then its formula in plain torch around the frame's primitive;
* ``_frame.py`` — what every loss does around its formula, once: the checks (``_options.py``), the
  agreement, meeting the columns, the primitive (each row's value of a family, or their weighted sum)
  and the contract's reduction; ``_module.py``: the modules that hold a loss's options;
* ``_driver.py`` — the one block driver: the blocks and chunks a rank meets, two passes, the gradient
  formed in forward or in backward; ``_visit.py``: what one visit computes (its product, its states,
  its gradient's products); ``_tiles.py``: a Gram loss's pairs of tiles; ``_epilogue.py``: what a
  product goes through, eager or fused (``_fused.py``, ``_triton*.py``: CUDA), chosen once a call;
* ``_softmax.py``, ``_decoupled.py``, ``_sigmoid.py`` (gathered in ``_families.py``) — the families: a
  row's state across column blocks, merged exactly, its value and a block's logit gradient;
* ``_transports.py`` — which blocks a rank meets (``communication="gather"``: every column at once;
  ``"ring"``: one rank's block per hop) and where their gradients go;
* ``_targets.py``, ``_same_key.py``, ``_negatives.py`` — where a row's positives and left-out columns are,
  which pairs share a key, InfoNCE's extra negatives.

Adding a loss: ``docs/guides/adding-a-loss.md``.
"""

from contrastive_dist.losses._negatives import SharedNegatives
from contrastive_dist.losses._options import product_route
from contrastive_dist.losses.dcl import DCLLoss, dcl
from contrastive_dist.losses.hcl import HCLLoss, hcl
from contrastive_dist.losses.infonce import DistributedInfoNCE, info_nce
from contrastive_dist.losses.ntxent import NTXentLoss, nt_xent
from contrastive_dist.losses.siglip import SigLIPLoss, siglip
from contrastive_dist.losses.supcon import SupConLoss, supcon

__all__ = [
    "DCLLoss",
    "DistributedInfoNCE",
    "HCLLoss",
    "NTXentLoss",
    "SharedNegatives",
    "SigLIPLoss",
    "SupConLoss",
    "dcl",
    "hcl",
    "info_nce",
    "nt_xent",
    "product_route",
    "siglip",
    "supcon",
]
