"""The last rank exits with the code in $ZS_EXIT_CODE, the others succeed."""

import os
import sys

if __name__ == "__main__":
    last = int(os.environ["WORLD_SIZE"]) - 1
    sys.exit(int(os.environ["ZS_EXIT_CODE"]) if int(os.environ["RANK"]) == last else 0)
