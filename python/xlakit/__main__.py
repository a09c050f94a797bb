"""`python -m xlakit`: the `xlakit` command."""

import sys

from xlakit.cli import main

sys.exit(main())
