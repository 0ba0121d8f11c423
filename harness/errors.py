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
    status 2, before any heavy work; nothing is recorded. Any other exception propagates as it is."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ConfigError as exc:
            print(f"kvbench: bad config: {exc}", file=sys.stderr)
            sys.exit(BAD_CONFIG_EXIT)

    return wrapper  # type: ignore[return-value]
