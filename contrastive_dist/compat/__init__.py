"""Drop-ins: the class names, constructors and ``forward`` signatures of other libraries' losses, exact here.

* :mod:`contrastive_dist.compat.open_clip`: ``ClipLoss``, ``SigLipLoss`` (open_clip 3.3);
* :mod:`contrastive_dist.compat.lightly`: ``NTXentLoss`` (lightly 1.6);
* :mod:`contrastive_dist.compat.sentence_transformers`: ``MultipleNegativesRankingLoss``,
  ``CachedMultipleNegativesRankingLoss`` (sentence-transformers 6.2).

A training script changes one import line. None of these modules imports the library it mimics.
On one process each drop-in gives the original's value and gradients; under data parallelism it
gives the single-process loss of the global batch for any per-rank batch sizes, 0 included.
"""

from contrastive_dist.compat import lightly, open_clip, sentence_transformers

__all__ = ["lightly", "open_clip", "sentence_transformers"]
