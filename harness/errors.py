"""The errors every layer shares, and the one way an entry point reports bad input.

Torch-free and import-free, so that the cache protocol (harness.kv.base), the storage formats (harness.kv.quant),
the config and the dashboard can all raise and catch them without importing one another.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

BAD_CONFIG_EXIT = 2  # the exit status of bad input, as argparse's


class ConfigError(ValueError):
    """Bad input: the message is one line naming the field and what it allows."""


class Unsupported(Exception):
    """This combination cannot run here (a strategy on the wrong device, a format it cannot store): the point
    becomes a `status=unsupported` row with this reason, not an error."""


class KVPoolExhausted(MemoryError):
    """A sequence needed a block and the pool had none: out of KV memory, reported like any OOM."""


def exit_on_config_error(main: F) -> F:
    """Wrap an entry point: a ConfigError becomes one line on stderr (`kvbench: bad config: <field>: ...`) and exit
    status 2, before any heavy work; nothing is recorded, and what Hydra made for the job before it ran (its run
    folder's .hydra/ and log) is removed (remove_rejected_run). An Unsupported that reaches the entry point (a
    combination only the run itself found it cannot do; a sweep's points record theirs as rows instead) is the same
    one line (`kvbench: unsupported: ...`) and exit status 2. Any other exception propagates as it is."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (ConfigError, Unsupported) as exc:
            kind = "bad config" if isinstance(exc, ConfigError) else "unsupported"
            print(f"kvbench: {kind}: {exc}", file=sys.stderr)
            config = args[0] if args else None  # a Hydra entry point's composed config
            remove_rejected_run(results_dir=config.get("results_dir") if hasattr(config, "get") else None)
            sys.exit(BAD_CONFIG_EXIT)

    return wrapper  # type: ignore[return-value]


def remove_rejected_run(*, results_dir: str | None) -> None:
    """Hydra makes the job's folder (.hydra/ with the composed config, and <job>.log) before the entry point can
    check its input; a rejected job keeps nothing of it. Removed: that .hydra/ and log, then each folder left empty
    on the way up to results_dir (a multirun's sweep folder too, when its multirun.yaml is all it holds); never a
    file the job did not get from Hydra, never a folder that holds one, never results_dir itself. Outside a Hydra
    job this does nothing."""
    if "hydra" not in sys.modules:  # not a Hydra entry point: nothing was made before the check
        return
    import shutil
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    output_dir = hc.runtime.get("output_dir")
    if not output_dir:  # a multirun's up-front check: the launcher has made no folder yet
        return
    output = Path(output_dir).resolve()
    shutil.rmtree(output / ".hydra", ignore_errors=True)
    (output / f"{hc.job.name}.log").unlink(missing_ok=True)
    sweep = Path(hc.sweep.dir).resolve() if hc.mode.name == "MULTIRUN" else None
    stop = Path(results_dir).resolve() if results_dir else output.parent  # no results_dir: the job's folder only
    folder = output
    while folder != stop and folder.is_relative_to(stop) and folder.is_dir():
        entries = {entry.name for entry in folder.iterdir()}
        if folder == sweep and entries == {"multirun.yaml"}:  # the launcher's record of a sweep that never ran
            (folder / "multirun.yaml").unlink()
            entries = set()
        if entries:
            break
        folder.rmdir()
        folder = folder.parent
