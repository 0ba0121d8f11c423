"""Several `python -m experiments.decode ...` command lines run one after another in one interpreter, each as
`python -m` runs it (runpy, as __main__, its own sys.argv), its exit status and stderr kept apart.

For the tests of input the entry point refuses before anything is measured: each refusal is the entry point's own
(Hydra's composition, RunConfig's checks, the sweep's up-front check), and one process pays the interpreter, torch
and Hydra start once instead of once per command line (seconds each on 2 cores).

    python -m tests.run.cli_runs '[["model=tiny", "batch_size=0"], ["-m", "batch_size=1,0"]]'
    python -m tests.run.cli_runs '[{"module": "experiments.serve", "argv": ["tpot_slo_ms=fast"]}]'

prints one JSON list: {"returncode": int, "stdout": str, "stderr": str} per command line, in order. A command line
is a list (experiments.decode's arguments) or {"module": ..., "argv": [...]} for another entry point.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_entry_point(argv: list[str], module: str = "experiments.decode") -> dict:
    """One command line through `module` run as __main__: its exit status and output, as the interpreter would
    give them (0 when it returned, a SystemExit's code, 1 and the traceback for any other exception)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv = [module, *argv]
    returncode = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exc:  # sys.exit(n), or Hydra's own exit on a composition error
            if isinstance(exc.code, int) or exc.code is None:
                returncode = exc.code or 0
            else:  # sys.exit("message"): the interpreter prints it and exits 1
                print(exc.code, file=sys.stderr)
                returncode = 1
        except Exception:  # noqa: BLE001  (what an uncaught exception does to a process: its traceback, exit 1)
            traceback.print_exc()
            returncode = 1
    return {"returncode": returncode, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def spawn(lines: list) -> list[dict]:
    """Every command line of `lines` (as the command line of this module takes them) in one fresh interpreter, run
    from the repository root: their results, in order."""
    proc = subprocess.run([sys.executable, "-m", "tests.run.cli_runs", json.dumps(lines)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


if __name__ == "__main__":
    lines = json.loads(sys.argv[1])
    print(json.dumps([run_entry_point(**line) if isinstance(line, dict) else run_entry_point(line) for line in lines]))
