"""``python -m quickdraft``: the ``quickdraft`` command."""

import sys

from quickdraft.commands.cli import main

sys.exit(main())
