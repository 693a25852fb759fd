"""The engine: raw transports, the agreement between ranks, and the differentiable gather.

Bottom to top: ``_wire`` (collectives, routes chosen per device) and ``_ring`` (point-to-point ring
hops) move tensors without autograd; ``_agreement`` is the one exchange that makes every rank agree
on sizes, dtypes and options or raise the same error everywhere; :mod:`~contrastive_dist.engine.gather`
is the differentiable variable-size all-gather (reduce-scatter backward) and
:mod:`~contrastive_dist.engine.collectives` the tensor-parallel pairs built on it.
"""
