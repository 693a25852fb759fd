"""Where a training run writes, and a warning for a global batch too small to learn from.

:func:`run_folder` gives every new run a folder of its own, so a second run never replaces the
first one's checkpoints and plots; :func:`check_global_batch` says when the batch leaves each pair
too few negatives. Neither imports Lightning; both read the environment only as launchers set it.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> root = Path(tempfile.mkdtemp()) / "runs"
    >>> first, _ = run_folder(root)
    >>> second, _ = run_folder(root)
    >>> first.name, second.name
    ('version_0', 'version_1')
    >>> (first / "checkpoints").mkdir(parents=True); (first / "checkpoints" / "last.ckpt").touch()
    >>> folder, checkpoint = run_folder(root, resume=first)   # continues in the folder it names
    >>> folder == first, checkpoint.name
    (True, 'last.ckpt')
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

__all__ = ["check_global_batch", "run_folder"]

# Lightning's ddp launcher starts the other ranks of a machine as new processes with the parent's
# environment: the folder chosen by the parent travels in it, so every rank writes to the same one.
RUN_FOLDER_VARIABLE = "CONTRASTIVE_DIST_RUN_FOLDER"
_VERSION = re.compile(r"version_(\d+)")


def _holds_a_run(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def run_folder(root: Path, *, output_dir: Path | None = None, resume: Path | None = None,
               overwrite: bool = False, checkpoint_name: str = "checkpoints/last.ckpt") -> tuple[Path, Path | None]:
    """The folder a run writes to, and the checkpoint it resumes from (or ``None``).

    * New run, no ``output_dir``: a fresh ``root/version_N`` (``N`` one above the highest there).
    * New run with ``output_dir``: that folder, which must not hold a run yet; ``overwrite`` empties it.
    * ``resume``: a run folder (its ``checkpoint_name`` is loaded and the run continues in it)
      or a checkpoint file (the run continues in the folder that holds it as ``checkpoint_name``
      places it, e.g. the folder above its ``checkpoints/``, or in ``output_dir`` when given).

    The process that launches the others creates the folder and exports it in
    :data:`RUN_FOLDER_VARIABLE`; a process started by it (``LOCAL_RANK`` > 0) takes that folder.

    Args:
        root: where new runs get their ``version_N`` folders.
        output_dir: the run's folder instead of a new ``version_N``.
        resume: the run folder or checkpoint file to continue from.
        overwrite: let ``output_dir`` replace the run it holds (the folder is emptied).
        checkpoint_name: where a run keeps the checkpoint it resumes from, relative to its folder
            (Lightning's recipes: ``checkpoints/last.ckpt``; a plain PyTorch loop: ``checkpoint.pt``, say).

    Raises:
        ValueError: ``output_dir`` holds a run (and neither ``resume`` nor ``overwrite``), or
            ``resume`` names neither a folder with ``checkpoint_name`` nor a file.
    """
    checkpoint = None
    if resume is not None:
        resume = Path(resume).expanduser()
        if resume.is_dir():
            checkpoint = resume / checkpoint_name
            output_dir = output_dir or resume
        elif resume.is_file():
            checkpoint = resume
            # The run's folder is the one above the checkpoint's subfolders (``checkpoints/``), if it sits in them.
            subfolders = Path(checkpoint_name).parent.parts
            if output_dir is None and resume.parent.parts[len(resume.parent.parts) - len(subfolders):] == subfolders:
                output_dir = resume.parents[len(subfolders)]
        if checkpoint is None or not checkpoint.is_file():
            raise ValueError(f"--resume {resume}: expected a run folder holding {checkpoint_name} or a "
                             "checkpoint file; found neither")
    inherited = os.environ.get(RUN_FOLDER_VARIABLE)
    if inherited and os.environ.get("LOCAL_RANK", "0") != "0":  # a rank process: its launcher chose already
        return Path(inherited), checkpoint
    if output_dir is not None:
        folder = Path(output_dir).expanduser()
        if checkpoint is None and not overwrite and _holds_a_run(folder):
            raise ValueError(f"{folder} holds a run already; give another --output-dir, continue it with "
                             f"--resume {folder}, or replace it with --overwrite")
    else:
        root = Path(root).expanduser()
        taken = [int(match[1]) for path in (root.iterdir() if root.is_dir() else ())
                 if (match := _VERSION.fullmatch(path.name))]
        folder = root / f"version_{max(taken, default=-1) + 1}"
    if os.environ.get("RANK", "0") == "0":  # under torchrun, only global rank 0 writes
        if overwrite and checkpoint is None and _holds_a_run(folder):
            shutil.rmtree(folder)  # its logs would otherwise join this run's curves
        folder.mkdir(parents=True, exist_ok=True)
        os.environ[RUN_FOLDER_VARIABLE] = str(folder)
    return folder, checkpoint


def check_global_batch(global_batch: int, *, negatives: int, minimum: int = 16, advice: str = "") -> str | None:
    """Warn when each pair of the global batch meets fewer than ``minimum`` negatives; return the message.

    Args:
        global_batch: pairs per step over all processes (per-process batch × processes).
        negatives: the negatives each pair meets in such a batch (``global_batch - 1`` for CLIP,
            ``2 * global_batch - 2`` for NT-Xent's views).
        minimum: below this, training learns little: the task is too easy.
        advice: what to change, appended to the message (e.g. the flags).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     message = check_global_batch(3, negatives=2)
        >>> message.startswith("a global batch of 3 gives each pair 2 negatives"), len(caught)
        (True, 1)
        >>> check_global_batch(64, negatives=63) is None
        True
    """
    if negatives >= minimum:
        return None
    message = (f"a global batch of {global_batch} gives each pair {negatives} negatives, fewer than {minimum}: "
               "the loss is easy to drive down and little is learned" + (f"; {advice}" if advice else ""))
    warnings.warn(message, UserWarning, stacklevel=2)
    return message
