"""`python -m shardlb`: the same command line as `shardlb`."""

from __future__ import annotations

import sys

from shardlb.cli import main

if __name__ == "__main__":
    sys.exit(main())
