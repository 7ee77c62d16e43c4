"""The controller side of ddplab: what reads and reports a run on the controller, never shipped to a node.

:mod:`.rundir` reads a run folder (the one reader), :mod:`.summary` writes ``summary.json`` (the
one writer) and measures faults with :mod:`ddplab.faults`, :mod:`.straggler` finds slow ranks,
:mod:`.report` renders ``report.html`` (data, plots, html), :mod:`.bench_report` the bench's,
:mod:`.rdzv_store` runs the rendezvous TCPStore and :mod:`.lighthouse` the torchft lighthouse
(per_step engine), both under :mod:`.supervisor`. See docs/ARCHITECTURE.md.
"""
