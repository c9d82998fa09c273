"""``python -m amprewrite``: the command line (see :mod:`amprewrite.cli`)."""

from .cli.main import main

raise SystemExit(main())
