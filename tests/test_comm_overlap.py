"""The timed DDP comm hook overlaps a bucket's all-reduce with the rest of the backward pass
(ddplab.distributed.TimedAllReduce): the hook of a bucket that is not the step's last returns its
future without waiting; the last bucket's hook waits for every bucket of the step."""

from __future__ import annotations

import threading
import types

import torch
from ddplab.compression import CompressedAllReduce
from ddplab.distributed import TimedAllReduce


class Launched(TimedAllReduce):
    """A hook state whose buckets' synchronisations are futures the test completes."""

    def __init__(self) -> None:
        super().__init__(world_size=2)
        self.futures: list[torch.futures.Future] = []

    def launch(self, bucket):
        fut = torch.futures.Future()
        self.futures.append(fut)
        return fut


def bucket(last: bool):
    return types.SimpleNamespace(is_last=lambda: last)


def test_a_bucket_that_is_not_the_last_travels_while_backward_goes_on():
    state = Launched()
    first = TimedAllReduce.hook(state, bucket(last=False))
    second = TimedAllReduce.hook(state, bucket(last=False))
    assert not first.done() and not second.done()  # returned at once: nothing waited for
    assert state.pending == [first, second] and state.calls == 2


def test_the_last_bucket_waits_for_every_bucket_of_the_step():
    state = Launched()
    first = TimedAllReduce.hook(state, bucket(last=False))
    finish = threading.Timer(0.2, lambda: [f.set_result(torch.zeros(1)) for f in state.futures])
    finish.start()
    last = TimedAllReduce.hook(state, bucket(last=True))
    assert first.done() and last.done() and state.pending == []
    assert state.seconds >= 0.15  # the wait is the step's exposed communication time


def test_a_failed_bucket_raises_from_the_last_hook():
    state = Launched()
    TimedAllReduce.hook(state, bucket(last=False))
    state.futures[0].set_exception(RuntimeError("peer gone"))
    finish = threading.Timer(0.05, lambda: state.futures[1].set_result(torch.zeros(1)))
    finish.start()
    try:
        TimedAllReduce.hook(state, bucket(last=True))
    except RuntimeError as exc:
        assert "peer gone" in str(exc)
    else:
        raise AssertionError("the failed bucket did not raise")
    finish.join()


def test_compressed_hooks_overlap_the_same_way():
    state = CompressedAllReduce(2, "fp16")
    futures = []
    state._inner = lambda s, b: futures.append(torch.futures.Future()) or futures[-1]
    first = CompressedAllReduce.hook(state, bucket(last=False))
    assert not first.done() and state.pending == [first]
    state.reset()
    assert state.pending == [] and state.seconds == 0.0
