"""``python -m ddplab.report runs/<run_id>``: see :mod:`ddplab.report`."""

import sys

from ddplab.report import main

sys.exit(main())
