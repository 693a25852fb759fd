"""Contrastive losses that follow the gradient contract: each loss defined once, over either transport.

A loss is a function of this rank's rows against every rank's columns, met block by block:

* ``infonce.py``, ``ntxent.py``, ``siglip.py``, ``supcon.py``, ``dcl.py`` — each loss, in one file:
  its own checks and options, then its formula (family, rows, columns, targets, directions);
* ``_frame.py`` — what every loss does around its formula, once: the common checks, the agreement,
  meeting the columns, the kernel call and the contract's reduction; ``_module.py``: the modules'
  held options;
* ``_softmax.py``, ``_decoupled.py``, ``_sigmoid.py`` — the families' block kernel: a row's state across
  column blocks, merged exactly, and a block's logit gradient;
* ``_fused.py`` (gradients formed in forward, every column in one block) and ``_recomputed.py``
  (any blocks, recomputed in backward) — the passes that run a family over the blocks, with one
  shared accumulation of the inputs' gradients (``_kernel.py``);
* ``_columns.py`` — the transports: which blocks a rank meets (``communication="gather"``: every
  column at once; ``"ring"``: one rank's block per hop) and where the blocks' gradients go;
* ``_targets.py``, ``_negatives.py``, ``_options.py``, ``_reduction.py``, ``_precision.py`` — what a
  loss is made of: targets per block, extra negatives, option checks, the contract's reduction,
  the core's dtype.
"""

from contrastive_dist.losses._negatives import SharedNegatives
from contrastive_dist.losses.dcl import DCLLoss, dcl
from contrastive_dist.losses.infonce import DistributedInfoNCE, info_nce
from contrastive_dist.losses.ntxent import NTXentLoss, nt_xent
from contrastive_dist.losses.siglip import SigLIPLoss, siglip
from contrastive_dist.losses.supcon import SupConLoss, supcon

__all__ = [
    "DCLLoss",
    "DistributedInfoNCE",
    "NTXentLoss",
    "SharedNegatives",
    "SigLIPLoss",
    "SupConLoss",
    "dcl",
    "info_nce",
    "nt_xent",
    "siglip",
    "supcon",
]
