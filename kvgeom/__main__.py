"""``python -m kvgeom``: the command line (see :mod:`kvgeom.cli`)."""

import sys

from kvgeom.cli import main

sys.exit(main())
