"""tests/forked_runs.py runs a script as its command would, forked from its server or in a fresh process."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from forked_runs import ForkedRuns, forked_runs

SCRIPT = """\
import os, sys
from helper import shout  # the script's folder is first on sys.path
print(sys.argv[1:], os.getcwd() == sys.argv[1], os.environ["CHOICE"], __name__)
print(shout("to stderr"), file=sys.stderr)
if sys.argv[2] == "exit":
    sys.exit(3)
if sys.argv[2] == "raise":
    raise RuntimeError("on purpose")
if sys.argv[2] == "hang":
    child = os.fork()  # a process of the run's group, left behind unless the group is killed
    if child == 0:
        time.sleep(60)
    open("child.pid", "w").write(str(child))
    import time
    time.sleep(60)
"""


@pytest.mark.parametrize("server", [True, False], ids=["forked from the server", "a fresh process"])
def test_a_script_runs_as_its_command_with_its_exit_code_output_and_a_timeout(tmp_path: Path, server: bool) -> None:
    (tmp_path / "script.py").write_text("import time\n" + SCRIPT)
    (tmp_path / "helper.py").write_text("def shout(text):\n    return text.upper()\n")
    runs = forked_runs() if server else ForkedRuns(server=False)
    env = {**os.environ, "CHOICE": "b"}
    results = {how: runs.script([str(tmp_path / "script.py"), str(tmp_path), how], cwd=tmp_path, env=env, timeout=60)
               for how in ("return", "exit", "raise")}
    assert {how: result.returncode for how, result in results.items()} == {"return": 0, "exit": 3, "raise": 1}
    for how, result in results.items():
        assert result.stdout == f"['{tmp_path}', '{how}'] True b __main__\n"
        assert result.stderr.startswith("TO STDERR\n")
    assert "Traceback" in results["raise"].stderr and "RuntimeError: on purpose" in results["raise"].stderr
    if not server:
        return
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        runs.script([str(tmp_path / "script.py"), str(tmp_path), "hang"], cwd=tmp_path, env=env, timeout=3)
    assert time.monotonic() - start < 30
    child = Path(f"/proc/{(tmp_path / 'child.pid').read_text()}/stat")
    for _ in range(100):  # killed with the run: gone, or a zombie until something reaps it
        if not child.exists() or child.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the run's child outlived the timeout")
    assert runs.script([str(tmp_path / "script.py"), str(tmp_path), "exit"], cwd=tmp_path, env=env,
                       timeout=60).returncode == 3
