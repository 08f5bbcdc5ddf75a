"""``python -m tierfs.cli``: the ``tierfs`` command without the console script."""

import sys

from tierfs.cli.main import main

sys.exit(main())
