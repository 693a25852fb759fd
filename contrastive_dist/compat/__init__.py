"""Drop-ins: the class names, constructors and ``forward`` signatures of other libraries' losses, exact here.

* :mod:`contrastive_dist.compat.open_clip`: ``ClipLoss``, ``SigLipLoss`` (open_clip 3.3), and
  ``install()``, which makes open_clip's own training script build them
  (``python -m contrastive_dist.compat.open_clip_train ARGS`` runs that script so);
* :mod:`contrastive_dist.compat.lightly`: ``NTXentLoss``, ``DCLLoss``, ``DCLWLoss`` (lightly 1.6);
* :mod:`contrastive_dist.compat.sentence_transformers`: ``MultipleNegativesRankingLoss``,
  ``CachedMultipleNegativesRankingLoss`` (sentence-transformers 6.3).

A training script changes one import line. None of these modules imports the library it mimics
(``install()`` imports open_clip when called). On one process each drop-in gives the original's
value and gradients; under data parallelism every rank returns the single-process loss of the
global batch, and DDP averages its gradient, for any per-rank batch sizes, 0 included.
"""

from contrastive_dist.compat import lightly, open_clip, sentence_transformers

__all__ = ["lightly", "open_clip", "sentence_transformers"]
