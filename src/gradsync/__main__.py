"""``python -m gradsync …`` — see ``gradsync.cli``."""

import sys

from gradsync.cli import main

sys.exit(main())
