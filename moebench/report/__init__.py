"""Reports, built from results files only (never from live objects), so they work on results
copied from another machine.

- claims.py: measured values against the chapter's published figures, with a verdict each.
- collect.py: which run folders a report reads, and what they hold.
- figures.py: the PNG figures (matplotlib, Agg).
- render.py: REPORT.md, the self-contained report.html, the console's verdict table.
- build.py: `build_report`, what `moebench report` calls.
"""

from __future__ import annotations

from moebench.report.claims import compare, comparison_table, format_number, lookup, verdicts
from moebench.report.figures import plot_loss

__all__ = ["comparison_table", "compare", "format_number", "lookup", "plot_loss", "verdicts"]
