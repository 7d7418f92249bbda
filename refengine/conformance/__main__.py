"""``python -m refengine.conformance --target HOST:PORT ...`` (also ``refengine conformance``)."""

import sys

from refengine.conformance.command import main

sys.exit(main())
