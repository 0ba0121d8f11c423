"""What measuring one point makes: its row and, when the profiler ran, its top-ops table.

Torch-free and picklable (a dataclass of a dict and a DataFrame), since it crosses the measuring worker's pipe.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True)
class PointResult:
    row: dict  # flat named scalars, one per column of harness.store.schema (sweep_id is the caller's to add)
    ops: pd.DataFrame | None = (
        None  # the profiler's top ops (harness.measure.profile), written beside the row; None: none
    )
