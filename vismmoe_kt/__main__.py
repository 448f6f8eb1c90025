"""`python -m vismmoe_kt ...` (and `torchrun -m vismmoe_kt ...`) is the `vismmoe-kt` command."""

import sys

from .apps.cli import main

sys.exit(main())
