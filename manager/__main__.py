"""``python -m cairn.manager``: the cairn command line."""

import sys

from cairn.manager._cli import main

sys.exit(main())
