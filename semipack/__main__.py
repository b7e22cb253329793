"""``python -m semipack explain ...``: the command line (``semipack.cli``)."""

import sys

from .cli import main

sys.exit(main())
