"""What a stored Ceilings (harness/device/ceilings.py) reports: the memory roof a decode row is set against, the row's
ceilings columns, and the printed table of the measured figures beside the published spec.

Units: GB = 1e9 bytes, TFLOP = 1e12 floating-point operations.
"""

from __future__ import annotations

import math

import pandas as pd

from harness.device.ceilings import Ceilings
from harness.store.summary import text_table


def bandwidth_roof(ceilings: Ceilings) -> tuple[float, str]:
    """The memory roof of a decode row and its name: the streaming read, or the copy when none was measured
    (ceilings stored before METHOD_VERSION 3)."""
    if ceilings.read_bw_gbps is not None and math.isfinite(ceilings.read_bw_gbps) and ceilings.read_bw_gbps > 0:
        return ceilings.read_bw_gbps, "read"
    return ceilings.peak_bw_gbps, "copy"


def format_table(ceilings: Ceilings, spec: pd.DataFrame | None = None) -> str:
    """Measured ceilings with their spread, beside the published spec and their ratio when a spec row matches.

    The spec's bandwidth stands beside the read roof only: a datasheet's GB/s is what the memory delivers one way,
    and a copy counts every byte twice (read and written), so its ratio to the datasheet means nothing.
    """

    def spec_value(dtype_name: str | None) -> float | None:
        if spec is None:
            return None
        if dtype_name is None:  # bandwidth: the same on every row of the device
            return float(spec["peak_bw_gbps"].iloc[0])
        tflops = spec.loc[spec["dtype"] == dtype_name, "peak_tflops_dense"]
        return None if tflops.empty or pd.isna(tflops.iloc[0]) else float(tflops.iloc[0])

    def line(label: str, measured: float | str, spread: str = "", published: float | None = None, note=""):
        """One row of the table; a measured figure shows its spread beside it: "20.5 ± 1.2%" (median ± rse)."""
        if isinstance(measured, str):
            return dict(ceiling=label, measured=measured, spec=None, ratio=None, note=note)
        rse = ceilings.median_rse.get(spread)
        shown = f"{measured:.4g}" + (f" ± {rse:.1%}" if rse is not None and math.isfinite(rse) else "")
        ratio = measured / published if published is not None else None
        return dict(ceiling=label, measured=shown, spec=published, ratio=ratio, note=note)

    def tries_note(name: str) -> str:
        tries = ceilings.tries.get(name, 1)
        return f"; measured {tries} times, the tightest kept" if tries > 1 else ""

    read_note = "the roofline's memory roof: bytes read (a streaming sum)" + tries_note("read")
    if ceilings.read_bw_gbps is None:
        read_note = f"stored by method {ceilings.method_version}, before the read roof: force=true measures it"
    lines = [
        line("read bandwidth GB/s", ceilings.read_bw_gbps or "not measured", "read", spec_value(None), read_note),
        line("copy bandwidth GB/s", ceilings.peak_bw_gbps, "copy", note="bytes read + written" + tries_note("copy")),
    ]
    lines += [
        line(f"matmul {name} TFLOP/s", tflops, name, spec_value(name)) for name, tflops in ceilings.peak_tflops.items()
    ]
    lines += [line(f"matmul {name} TFLOP/s", "skipped", note=reason) for name, reason in ceilings.skipped.items()]
    if ceilings.tier_gbps:  # the tiers experiment's figures (python -m experiments.tiers), when stored
        direct = "O_DIRECT" if ceilings.tier_direct_io else "buffered, pages dropped"
        where = {"d2h": "device -> host tier", "h2d": "host tier -> device"}
        for name, value in ceilings.tier_gbps.items():
            detail = where.get(name, f"{direct}, {ceilings.tier_disk_dir}")
            note = f"measured: {ceilings.tier_block_bytes} B blocks, {detail}"
            lines.append(line(f"tier {name} GB/s", value, note=note))
    table = text_table(
        pd.DataFrame(lines, columns=["ceiling", "measured", "spec", "ratio", "note"]),
        formatters={
            "spec": "{:.4g}".format,
            "ratio": "{:.2f}".format,
        },
        left=("ceiling", "note"),
    )
    threads = f"{ceilings.n_threads} threads" if ceilings.device == "cpu" else f"{ceilings.n_sms} SMs"
    header = (
        f"{ceilings.device_name} ({ceilings.device}, {threads}), fingerprint {ceilings.fingerprint}, "
        f"measured {ceilings.measured_at}{' (quick)' if ceilings.quick else ''}"
    )
    footer = (
        [f"spec: {spec['device_name'].iloc[0]}, dense peaks (harness/device/spec_peaks.csv)"]
        if spec is not None
        else []
    )
    return "\n".join([header, table, *footer])


def row_columns(ceilings: Ceilings, dtype_name: str) -> dict:
    """The ceilings columns of a decode row whose compute dtype is `dtype_name` (None where it was not measured).

    peak_bw_gbps is the roof the roofline uses (bandwidth_roof: the read, else the copy) and bw_roof names it; both
    measured bandwidths ride along, so that a reader can set the row against either.
    """
    roof_gbps, roof = bandwidth_roof(ceilings)
    return {
        "ceilings_fingerprint": ceilings.fingerprint,
        "peak_bw_gbps": roof_gbps,
        "bw_roof": roof,
        "peak_read_bw_gbps": ceilings.read_bw_gbps,
        "peak_copy_bw_gbps": ceilings.peak_bw_gbps,
        "peak_tflops": ceilings.peak_tflops.get(dtype_name),
    }
