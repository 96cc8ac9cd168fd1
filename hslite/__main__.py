"""`python -m hslite`: the command line, in the form torchrun starts a module (`torchrun ... -m hslite fit ...`)."""

import sys

from hslite.cli import main

if __name__ == "__main__":  # a spawned rank imports the main module again: it must not run the command a second time
    sys.exit(main())
