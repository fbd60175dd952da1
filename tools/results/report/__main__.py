"""`python -m tools.results.report`: see tools.results.report.cli."""

import sys

from tools.results.report.cli import main

sys.exit(main())
