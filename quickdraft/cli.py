"""``python -m quickdraft.cli``, as earlier releases ran the command (and the dated benchmark
runs record it): the ``quickdraft`` command, now quickdraft/commands/cli.py."""

import sys

from quickdraft.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
