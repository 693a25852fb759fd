"""The engine: raw transports, the agreement between ranks, and the differentiable gather.

Bottom to top: ``_wire`` (collectives, routes chosen per device) and ``_ring`` (point-to-point ring
hops) move tensors without autograd; ``_agreement`` is the one exchange that makes every rank agree
on sizes, dtypes, device types, options and scalar values or raise the same error everywhere;
``_faults``, ``_rollcall``, ``_progress`` and ``_crossed`` name a rank that died or a collective
that can never meet; :mod:`~contrastive_dist.engine.gather`
is the differentiable variable-size all-gather (reduce-scatter backward) and
:mod:`~contrastive_dist.engine.collectives` the tensor-parallel pairs built on it.
"""
