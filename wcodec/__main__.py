"""`python -m wcodec`: the same command line as the `wcodec` console script."""
import sys

from .entry import main

sys.exit(main())
