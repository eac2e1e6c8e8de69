"""``python -m services.cli``: the ``rtrl`` command without the console script."""

import sys

from services.cli import main

sys.exit(main())
