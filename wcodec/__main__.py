"""`python -m wcodec`: the same command line as the `wcodec` console script."""
import sys

from .cli import main

sys.exit(main())
