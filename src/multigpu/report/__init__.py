"""``multigpu report RUN_DIR``: one self-contained HTML page about a run or a bench (runs in the launcher)."""

from multigpu.report.html import build_report, write_report

__all__ = ["build_report", "write_report"]
