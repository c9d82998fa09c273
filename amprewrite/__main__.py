"""``python -m amprewrite``: the command line (see :mod:`amprewrite.cli`)."""

from .cli import main

raise SystemExit(main())
