"""Worker exit codes shared by the trainer (ddplab.train) and the node agent (ddplab.agent).

A module of constants only, so that the agent reads them without importing ddplab.train (and so
torch) just for a number.
"""

from __future__ import annotations

#: per_step: the replica was cut off from its group (it waited for the group already); the agent
#: ends instead of restarting such a worker.
EXIT_CUT_OFF = 4
