"""The dashboard's charts, one module per page of dashboard/app_pages/ (overview, roofline, memory, strategies,
latency, profile), and common.py: the rules and helpers every chart shares. Import from the page's module."""
