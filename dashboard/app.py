"""kvbench dashboard: `streamlit run dashboard/app.py` (KVBENCH_RESULTS=folder sets the default results folder).

Navigation only: the sidebar loads and filters the rows (dashboard/sidebar.py); each page is a file in app_pages/.
"""

import streamlit as st

from dashboard.sidebar import sidebar

st.set_page_config(page_title="kvbench", layout="wide")
sidebar()
st.navigation(
    [
        st.Page("app_pages/overview.py", title="Overview", url_path="overview", default=True),
        st.Page("app_pages/roofline.py", title="Roofline & crossover", url_path="roofline"),
        st.Page("app_pages/memory.py", title="Memory ledger", url_path="memory"),
        st.Page("app_pages/strategies.py", title="Cache strategies", url_path="strategies"),
        st.Page("app_pages/latency.py", title="Latency", url_path="latency"),
        st.Page("app_pages/profile.py", title="Profile", url_path="profile"),
        st.Page("app_pages/compare.py", title="Compare", url_path="compare"),
        st.Page("app_pages/serving.py", title="Serving", url_path="serving"),
        st.Page("app_pages/tiers.py", title="KV tiers & transfer", url_path="tiers"),
    ]
).run()
