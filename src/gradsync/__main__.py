"""``python -m gradsync …`` — see ``gradsync.apps.cli``."""

import sys

from gradsync.apps.cli import main

sys.exit(main())
