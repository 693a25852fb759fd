"""Return from a gloo collective only once the backend has let go of every tensor it was handed.

Why: a process that used gloo could abort at interpreter exit, after all its work, with
"terminate called without an active exception" (SIGABRT). gloo runs each collective on one of its
worker threads, which keeps a reference to the work, and so to its tensors, for a moment *after*
marking it complete: ``wait()`` has returned, Python drops its tensors first, and the tensor's
Python object is kept alive for C++ (PyTorch's "PyObject preservation"). When the worker thread
then lets go, it takes the GIL to free that Python object; if the interpreter is finalizing by
then (the collective was among the last of the program and the thread was descheduled, as on a
loaded machine), CPython ends the thread with ``pthread_exit``, whose unwinding through a
``noexcept`` C++ frame calls ``std::terminate``. (``destroy_process_group`` does not help: under
DDP the process group stays referenced from C++ and its threads live until the process ends.)

The cure for what the package hands over: every CPU tensor goes to the collective as a *view made
for the call*, and after the wait the call drops its views and returns only once the storages'
reference counts are back where they were, i.e. once the worker thread has dropped its references
too (it needs no more than a brief GIL hand-over, given by sleeping). Then no package tensor can be
freed by a gloo thread later, at exit or otherwise. The check costs a few microseconds per call and
usually finds the references gone at once. Accelerator tensors are left alone: their collectives
are asynchronous on a stream, and waiting for the backend would serialise them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["settled"]

_GIVE_UP_S = 2.0
"""Longer than any descheduled thread takes; past it the call returns anyway (it never hangs on this)."""


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
"""A private counter of torch's; where a torch lacks it, calls return without waiting (as before)."""


def _use_count(tensor: Tensor) -> int:
    return int(_STORAGE_USE_COUNT(tensor.untyped_storage()._cdata)) if _STORAGE_USE_COUNT is not None else 0


def settled(run: Callable[[list[Tensor]], object], tensors: Sequence[Tensor]) -> None:
    """Call ``run(views)`` with a view of each tensor; return once the backend let go of the views.

    ``run`` posts the collective on the views (or on further views of them) and waits for it;
    it must not keep any of them. For tensors not on the CPU, ``run`` gets the tensors themselves.

    Example:
        >>> import torch
        >>> from contrastive_dist.engine._settle import settled
        >>> buffer = torch.zeros(3)
        >>> settled(lambda views: views[0].add_(1.0), [buffer])  # a stand-in for a collective
        >>> buffer
        tensor([1., 1., 1.])
    """
    if not all(tensor.device.type == "cpu" for tensor in tensors):
        run(list(tensors))
        return
    before = [_use_count(tensor) for tensor in tensors]
    run([tensor.view(tensor.shape) for tensor in tensors])  # the views die with this call's frame
    deadline, pause = time.monotonic() + _GIVE_UP_S, 0.0
    while any(_use_count(tensor) > count for tensor, count in zip(tensors, before)):
        if time.monotonic() > deadline:
            return
        time.sleep(pause)  # lets the worker thread take the GIL if it needs it to let go
        pause = min(max(2 * pause, 1e-5), 1e-3)
