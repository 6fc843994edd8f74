"""``python -m cairn.manager``: the cairn command line."""

import sys

from cairn.manager._surfaces.cli import main

sys.exit(main())
