"""``python -m conduit ...``: the ``conduit`` command line (the same as the console script)."""

from __future__ import annotations

import sys

from conduit_entry import main

sys.exit(main())
