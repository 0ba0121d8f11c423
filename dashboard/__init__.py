"""The Streamlit dashboard: `streamlit run dashboard/app.py` (results folder: the sidebar, or KVBENCH_RESULTS)."""
