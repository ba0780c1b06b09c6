"""``python -m quickdraft.demo`` (``make demo``): quickdraft/commands/demo.py."""

import sys

from quickdraft.commands.demo import main

if __name__ == "__main__":
    sys.exit(main())
