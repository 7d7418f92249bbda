"""``python -m refengine.cli`` = the ``refengine`` command."""

import sys

from refengine.cli import main

sys.exit(main())
