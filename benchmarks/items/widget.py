"""Item 5: widget latency, measured by :mod:`benchmarks.widget_latency` in Chromium."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.suite import Config


def bench_widget(cfg: Config) -> dict:
    """Item 5: widget latency from ``benchmarks/widget_latency.py`` (another developer's), if it and Chromium exist."""
    if not cfg.widget:
        return {"status": "skipped", "note": "not run (the default in --quick, which must stay under a minute: "
                                             "the widget measurement starts a browser); pass --widget to run it"}
    if not (Path(__file__).resolve().parents[1] / "widget_latency.py").is_file():
        return {"status": "skipped", "note": "benchmarks/widget_latency.py is not there yet"}
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
                   None)
    if browser is None:
        return {"status": "skipped", "note": "no Chromium found on PATH"}
    try:
        from benchmarks import widget_latency

        result = widget_latency.run(quick=cfg.quick)
    except Exception as exc:  # a broken optional item must not lose the rest of the run
        return {"status": "error", "note": f"{type(exc).__name__}: {exc}"[:800]}
    return {"status": "ok", "browser": browser, "result": result}
