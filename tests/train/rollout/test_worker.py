"""The rollout worker process: it never outlives the trainer that started it."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time

from klpo.train.rollout.worker import next_message


def test_messages_are_read_in_order_while_the_parent_lives():
    inbox: queue.Queue = queue.Queue()
    inbox.put(("weights", 1))
    inbox.put(("sample", 2))
    assert next_message(inbox, lambda: True, poll_s=0.01) == ("weights", 1)
    assert next_message(inbox, lambda: True, poll_s=0.01) == ("sample", 2)


def test_an_empty_inbox_and_a_dead_parent_mean_stop():
    # a trainer killed with kill -9 sends no "stop": before, the worker waited on its inbox
    # forever, holding a copy of the policy
    checks = iter([True, True, False])
    assert next_message(queue.Queue(), lambda: next(checks), poll_s=0.01) == ("stop", None)


def _child(inbox) -> None:  # the worker's wait, in a process whose parent is killed
    next_message(inbox, poll_s=0.05)


def _parent(ready) -> None:
    ctx = multiprocessing.get_context("spawn")
    inbox = ctx.Queue()
    child = ctx.Process(target=_child, args=(inbox,))
    child.start()
    ready.put(child.pid)
    time.sleep(60)  # killed before this ends


def test_the_worker_exits_when_its_trainer_is_killed_outright():
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    parent = ctx.Process(target=_parent, args=(ready,))
    parent.start()
    child_pid = ready.get(timeout=60)
    os.kill(parent.pid, signal.SIGKILL)
    parent.join()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        # reap it if it became ours (it did not: it is init's); poll
        time.sleep(0.1)
    else:
        os.kill(child_pid, signal.SIGKILL)
        raise AssertionError("the worker outlived its killed parent by 30 s")
