"""``python -m benchmarks.localization``: see :mod:`benchmarks.localization.run`."""

import sys

from benchmarks.localization.run import main

if __name__ == "__main__":
    sys.exit(main())
