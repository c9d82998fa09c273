"""``python -m amprewrite``: the command line (see :mod:`amprewrite._cli`)."""

from ._cli import main

raise SystemExit(main())
