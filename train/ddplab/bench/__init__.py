"""The node-side benchmarks, run as torchrun workers on the trainers (shipped in the wheel).

:mod:`.links` (pairwise bandwidth/RTT), :mod:`.allreduce` (gloo all-reduce sweep), :mod:`.cluster`
(both in one job), :mod:`.costmodel` (the ring all-reduce model their records compare with) and
:mod:`.worker` (joining the group, the exit-code contract). Their report is
:mod:`ddplab.controller.bench_report`. :mod:`.results` is the controller's writer of every
benchmark's results file (``benchmarks/results/<name>.md``).
"""
