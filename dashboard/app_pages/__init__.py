"""The dashboard's pages, in the order the navigation lists them: url path (also the file app_pages/<path>.py) ->
title. dashboard/app.py builds its navigation from this, and `python -m dashboard.browser --page` takes its choices
from it, so a page added here is served, visited and screenshotted everywhere; one not added is served nowhere."""

PAGES = {
    "overview": "Overview",  # the default page: st.navigation serves it at "/", not at its url path
    "roofline": "Roofline & crossover",
    "memory": "Memory ledger",
    "strategies": "Cache strategies",
    "latency": "Latency",
    "profile": "Profile",
    "compare": "Compare",
    "serving": "Serving",
    "tiers": "KV tiers & transfer",
}
DEFAULT_PAGE = next(iter(PAGES))
