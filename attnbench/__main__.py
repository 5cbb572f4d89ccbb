"""``python -m attnbench`` — the same as the ``attnbench`` command."""

import sys

from attnbench.cli import main

sys.exit(main())
