"""sentence-transformers' own test files for its ranking losses, run against the originals and the drop-ins.

Run, with a checkout of sentence-transformers' repository (its ``tests/`` folder; the test files are
not in the wheel nor the sdist)::

    git clone https://github.com/huggingface/sentence-transformers /tmp/st
    python benchmarks/st_own_tests.py --repo /tmp/st        # test_cmnrl.py test_gradcache.py test_merged_forward.py

The files are copied to a temporary folder (with the helpers they import) and run twice by pytest:
with sentence-transformers' ``MultipleNegativesRankingLoss`` and ``CachedMultipleNegativesRankingLoss``,
then with the drop-ins put in their place in ``sentence_transformers.sentence_transformer.losses``
(where the files import them from). Nothing is downloaded: the hub model the files load
(``stsb_bert_tiny_model``, ``distilbert/distilbert-base-uncased``) is a random BERT of the same
shape built here (``tests/tiny_bert.py``: 128-d, 2 layers, dropout 0.1, a WordPiece tokenizer over
characters). The report gives the pass counts and every test that fails with the drop-ins, with the
first line of its error.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ["tests/__init__.py", "tests/utils.py", "tests/sentence_transformer/__init__.py",
           "tests/sentence_transformer/losses/__init__.py", "tests/sentence_transformer/losses/utils.py"]
CONFTEST = '''
import os
from pathlib import Path

import pytest
import sentence_transformers
from sentence_transformers.sentence_transformer import losses
from tiny_bert import save_tiny_bert, sentence_model

MODEL = save_tiny_bert(Path(os.environ["TINY_BERT_DIR"]), hidden=128, layers=2, dropout=0.1, pieces=True)
_init = sentence_transformers.SentenceTransformer.__init__


def _local_init(self, model_name_or_path=None, *args, **kwargs):  # a hub name: the tiny BERT instead
    if isinstance(model_name_or_path, str) and not Path(model_name_or_path).exists():
        model_name_or_path = str(MODEL)
    _init(self, model_name_or_path, *args, **kwargs)


sentence_transformers.SentenceTransformer.__init__ = _local_init
if os.environ.get("DROP_INS") == "1":
    from contrastive_dist.compat import sentence_transformers as drop_ins

    losses.MultipleNegativesRankingLoss = drop_ins.MultipleNegativesRankingLoss
    losses.CachedMultipleNegativesRankingLoss = drop_ins.CachedMultipleNegativesRankingLoss


@pytest.fixture()
def stsb_bert_tiny_model():
    return sentence_model(MODEL, hidden=128)
'''


def run(folder: Path, files: list[str], drop_ins: bool) -> tuple[dict[str, int], dict[str, str]]:
    """Counts of each outcome, and each failing test's first error line."""
    env = {**os.environ, "DROP_INS": "1" if drop_ins else "0", "TINY_BERT_DIR": str(folder / "tiny_bert"),
           "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT), str(ROOT / "tests")]), "HF_HUB_OFFLINE": "1"}
    paths = [f"tests/sentence_transformer/losses/{name}" for name in files]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "-o",
                             "addopts=", "--tb=short", *paths], cwd=folder, env=env, capture_output=True, text=True)
    counts = {kind: int(number) for number, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)",
                                                               result.stdout.splitlines()[-1])}
    failures = {}
    for line in result.stdout.splitlines():
        match = re.match(r"(FAILED|ERROR) (\S+)(?: - (.*))?", line)
        if match:
            failures[match.group(2)] = (match.group(3) or "")[:200]
    return counts, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="a checkout of sentence-transformers")
    parser.add_argument("--files", nargs="+", default=["test_cmnrl.py", "test_gradcache.py", "test_merged_forward.py"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        for name in HELPERS + [f"tests/sentence_transformer/losses/{name}" for name in args.files]:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(args.repo / name, folder / name)
        (folder / "conftest.py").write_text(CONFTEST)
        for drop_ins in (False, True):
            counts, failures = run(folder, args.files, drop_ins)
            print(f"{'drop-ins' if drop_ins else 'originals'}: {counts}")
            for test, error in failures.items():
                print(f"  {test}: {error}")


if __name__ == "__main__":
    main()
