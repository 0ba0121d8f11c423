"""Published dense peaks per device and dtype (harness/device/spec_peaks.csv, one citation per row).

Apart from harness.device.ceilings (which measures, and needs torch) so that the dashboard can draw a datasheet roof without
importing torch: seconds at start-up on a small machine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

SPEC_PEAKS_CSV = Path(__file__).with_name("spec_peaks.csv")


def spec_peaks() -> pd.DataFrame:
    """Published dense peaks, one row per (device, dtype), each with its source (harness/device/spec_peaks.csv)."""
    return pd.read_csv(SPEC_PEAKS_CSV, comment="#", skipinitialspace=True)


def spec_for(name: str) -> pd.DataFrame | None:
    """The spec rows of the device whose name_pattern (a case-insensitive regex) matches `name`, or None.

    "NVIDIA H200" and "H200 SXM" find the H200 SXM rows; "NVIDIA H200 NVL" does not (different clocks and power).
    """
    peaks = spec_peaks()
    for device_row in peaks.drop_duplicates("device_name").itertuples():
        if re.search(device_row.name_pattern, name, flags=re.IGNORECASE):
            return peaks[peaks["device_name"] == device_row.device_name].reset_index(drop=True)
    return None


SPEC_LINKS_CSV = Path(__file__).with_name("spec_links.csv")


def spec_links() -> pd.DataFrame:
    """Datasheet links (PCIe 5.0 x16, NVLink 4, 400 Gb/s RDMA): GB/s per direction, each with its source
    (harness/device/spec_links.csv), for the PD transfer's extrapolated rows."""
    return pd.read_csv(SPEC_LINKS_CSV, comment="#", skipinitialspace=True)
