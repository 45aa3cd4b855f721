"""``python -m multigpu`` -> the ``multigpu`` command line (runs outside the ranks)."""

from multigpu.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
