"""One module per benchmark item, each with its ``bench_*`` function; :mod:`benchmarks.suite` runs them.

Items: :mod:`~benchmarks.items.trace_cost` (1), :mod:`~benchmarks.items.single_variant` (2),
:mod:`~benchmarks.items.gallery` (3), :mod:`~benchmarks.items.memory` (4), :mod:`~benchmarks.items.widget` (5),
:mod:`~benchmarks.items.trace_many` (6).
"""

from __future__ import annotations


def clear_cam_caches() -> None:
    """Empty vitcam_nb's per-trace view and checklist caches (items 2 and 3 time "cold caches" calls with it).

    Example:
        >>> clear_cam_caches()
    """
    from vitcam_nb.compute.report_cache import clear_reports
    from vitcam_nb.compute.view import clear_views

    clear_reports()
    clear_views()
