"""``python -m kvgeom``: the command line (see :mod:`kvgeom.cli`)."""

import sys

from .cli import main

sys.exit(main())
