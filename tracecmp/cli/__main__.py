import sys

from tracecmp.cli.main import main

sys.exit(main())
