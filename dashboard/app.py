"""kvbench dashboard: `streamlit run dashboard/app.py` (KVBENCH_RESULTS=folder sets the default results folder).

Navigation only: the sidebar loads and filters the rows (dashboard/sidebar.py); each page is a file in app_pages/,
listed in app_pages/__init__.py.
"""

import streamlit as st

from dashboard.app_pages import DEFAULT_PAGE, PAGES
from dashboard.sidebar import sidebar

st.set_page_config(page_title="kvbench", layout="wide")
sidebar()
st.navigation(
    [
        st.Page(f"app_pages/{url_path}.py", title=title, url_path=url_path, default=url_path == DEFAULT_PAGE)
        for url_path, title in PAGES.items()
    ]
).run()
