"""Rank 1 fails at once; the others would sleep for a minute unless the launcher stops them."""

import os
import time

if __name__ == "__main__":
    if os.environ["RANK"] == "1":
        raise ValueError("boom from rank 1")
    time.sleep(60)
