"""``python -m ddplab.controller.report runs/<run_id>``: see :mod:`ddplab.controller.report`."""

import sys

from ddplab.controller.report import main

sys.exit(main())
