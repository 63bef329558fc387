"""``python -m pagedopt.memory``: the command line of pagedopt.memory.cli (as ``pagedopt-mem``)."""
import sys

from .cli import main

sys.exit(main())
