import sys

from xlakit.cli import main

sys.exit(main())
