"""python -m normexport: see normexport.cli."""

import sys

from normexport.cli import main

sys.exit(main())
