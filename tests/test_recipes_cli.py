"""The recipes' command lines: help and bad flags answer before torch loads; one default per flag, plain text."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_recipes import RECIPES

# Runs a recipe as `python recipes/<name> ...` would, then says whether torch, Lightning or torchvision loaded.
PROBE = """
import runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
sys.path.insert(0, {recipes!r})
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as stop:  # sys.exit("error: ...") prints its message only when it ends the interpreter
    print(stop.code if isinstance(stop.code, str) else "", file=sys.stderr)
print("LOADED", sorted(name for name in ("torch", "lightning", "torchvision") if name in sys.modules))
"""


def probe(recipe: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = PROBE.format(recipes=str(RECIPES))
    return subprocess.run([sys.executable, "-c", code, str(RECIPES / recipe), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("recipe", ["clip.py", "simclr.py"])
def test_help_and_bad_flags_answer_without_importing_torch(recipe: str, tmp_path: Path) -> None:
    for args, stream in ((["--help"], "stdout"), (["--data", "nowhere:x"], "stderr"), (["--max-steps", "x"], "stderr")):
        result = probe(recipe, *args, cwd=tmp_path)
        assert "LOADED []" in result.stdout, (args, result.stdout[-500:], result.stderr[-2000:])
        assert ("usage:" if args == ["--help"] else "error") in getattr(result, stream), args
    missing = probe("clip.py", "--data", "csv:nowhere.csv", cwd=tmp_path)
    assert "LOADED []" in missing.stdout and "no such file" in missing.stderr


@pytest.mark.parametrize("recipe", ["clip.py", "simclr.py"])
def test_help_states_each_default_once_in_plain_text_with_real_links(recipe: str, tmp_path: Path) -> None:
    usage = subprocess.run([sys.executable, str(RECIPES / recipe), "--help"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, check=True).stdout
    assert "``" not in usage and "(default: None)" not in usage and "README" not in usage
    flags = re.split(r"\n  (?=--)", usage.split("options:", 1)[1])
    for flag in flags:
        assert len(re.findall(r"default", flag, flags=re.IGNORECASE)) <= 1, flag
    root = RECIPES.parent
    for link in re.findall(r"docs/[\w/.-]+\.md", " ".join(usage.split())):
        assert (root / link).is_file(), link
    assert "docs/guides/gather-and-ring.md" in " ".join(usage.split())


def test_caption_ids_help_says_what_it_does_on_a_csv_and_the_floor_without_ids(tmp_path: Path) -> None:
    usage = " ".join(subprocess.run([sys.executable, str(RECIPES / "clip.py"), "--help"], cwd=tmp_path,
                                    capture_output=True, text=True, timeout=120, check=True).stdout.split())
    assert "the CSV's id column when it has one" in usage and "about log(k)" in usage
    assert "--csv-id-column" in usage and "(default: id)" in usage
