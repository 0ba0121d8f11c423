"""Result rows and tables, from their column contract to disk and back.

schema (the contracts: COLUMNS, FRONTIER_COLUMNS), atomic (the one atomic writer), disk (write and load rows, ops
and frontier tables), maintain (export, compact), diff (compare rows), summary (the one table printer), cli
(kvbench-results, also `python -m harness.store`).
"""
