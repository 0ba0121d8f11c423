"""What the device can do: its ceilings, measured once per device and stored (ceilings.py, over bandwidth.py's read
and copy roofs and ceiling_timing.py's discipline), read back for a row or a table (ceiling_report.py), and the
published figures they are checked against (spec.py over spec_peaks.csv and spec_links.csv, each row cited)."""
