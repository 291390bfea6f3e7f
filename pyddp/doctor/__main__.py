"""`python -m pyddp.doctor [--selftest]`."""

import sys

from . import main

sys.exit(main())
