"""``python -m cacheblend_rag``: the same command line as ``cacheblend-rag``."""

import sys

from cacheblend_rag.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
