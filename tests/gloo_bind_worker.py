"""One rank of the gloo binding test (tests/test_gloo_bind.py), run inside a network namespace.

Joins the group through ddplab.distributed (env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; DDPLAB_GLOO_ADDR or GLOO_SOCKET_IFNAME choose gloo's address), all-reduces rank + 1
and prints ``sum=<value>``. argv[1]: the process-group timeout in seconds.
"""

import sys

from ddplab.distributed import DistEnv, all_reduce_scalar, destroy_process_group, init_process_group

env = DistEnv.from_environ()
init_process_group(env, float(sys.argv[1]))
print(f"sum={all_reduce_scalar(float(env.rank + 1)):g}", flush=True)
destroy_process_group()
