"""python -m pyddp.bench: see pyddp.bench.cli."""

import sys

from .cli import main

sys.exit(main())
