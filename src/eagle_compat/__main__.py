"""`python -m eagle_compat SCRIPT.py ARGS...` (or `-m MODULE ARGS...`): run it unmodified under install()."""
import sys

from .launcher import main

if __name__ == "__main__":
    sys.exit(main())
