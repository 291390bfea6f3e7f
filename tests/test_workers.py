"""Replica workers keep their own intra-op thread count."""

import threading

import torch

from pyddp.replicas.workers import _init_worker


def test_worker_keeps_its_intra_op_thread_count():
    # torch sets a thread's intra-op count again, to the last count any thread
    # set, at that thread's first parallel op. A replica worker must not pick up
    # the caller's count that way: with 2 CPU replicas on 2 cores each worker
    # gets 1 thread, and a second OpenMP team would make libgomp stop spinning
    # for every parallel op in the process.
    caller = torch.get_num_threads()
    initialized, caller_set = threading.Event(), threading.Event()
    seen = []

    def worker():
        _init_worker(1, None)
        initialized.set()
        caller_set.wait()
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    initialized.wait()
    torch.set_num_threads(caller + 1)  # the caller sets its own count meanwhile
    caller_set.set()
    t.join()
    torch.set_num_threads(caller)
    assert seen == [1]
