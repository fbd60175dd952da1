"""`python -m tools.data`: see tools.data.cli."""

import sys

from tools.data.cli import main

sys.exit(main())
