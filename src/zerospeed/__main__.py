"""``python -m zerospeed``: the same as the ``zerospeed`` console script."""

import sys

from zerospeed.launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
