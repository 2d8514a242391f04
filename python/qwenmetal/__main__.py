"""``python -m qwenmetal``: the same as the ``qwenmetal`` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
