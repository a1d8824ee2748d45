"""megatron-core's checkpoint writer writes a rank's files in threads of the rank, not in forked processes.

Every ``torch_dist`` save, synchronous ones included, goes through ``FileSystemWriterAsync``: per save and rank it
forks one writer process per file and joins them with a ``multiprocessing`` Queue and JoinableQueue, and it reports
through a queue served by a Manager process (``spawn``: 3-7 s at a process's first save). Those queues are POSIX
named semaphores, 11 ``sem_open`` calls per rank and save (counted with ``strace``, and by
``tests/test_checkpoint_compat.py``). Each creates a file in
``/dev/shm`` under a random name (glibc's ``sem.XXXXXX``, linked to ``sem.mp-...``) and unlinks it microseconds later.
A rank SIGKILLed inside one of them (a node failure, or ``megarl train`` killed: its ranks die with it) leaves that
file behind, named by nothing that ties it to the run, so no sweep can remove it. It happened once in CI.

Here (``install``, idempotent, megatron-core 0.16.x, on CPU and GPU alike):
- ``FileSystemWriterAsync.write_preloaded_data_multiproc`` runs megatron's own per-file writer
  (``write_preloaded_data``, unchanged) in one thread per file, with ``queue.Queue`` in place of the process queues
  (the threads' file writes and ``fsync`` release the GIL; torch's own ``FileSystemWriter`` writes in threads too);
- the results queue is a new ``queue.Queue`` of this process per save (the writer object keeps it from its write
  plan to ``retrieve_write_results``), not one Manager's queue for the process's life.
No process, semaphore or Manager is created by a save. The write plan, the files and their bytes are megatron's.
megatron's asynchronous save (a persistent worker process) is not used by megarl and would not work with this
patch; ``megarl.checkpoint`` saves synchronously.
"""

from __future__ import annotations

import queue
import threading

from megarl.compat.megatron_fixes import _applies  # the same megatron-core versions

_state = {"original": None}


def _write_in_threads(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """``write_preloaded_data_multiproc``'s contract (one ``{file index: write results}`` or an exception into
    ``global_results_queue``), with a thread per file."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results, count = queue.Queue(), queue.Queue()
    threads = []
    for i, bucket in enumerate(write_buckets):
        count.put(i)  # the writer takes one item and marks it done when its file is written
        threads.append(
            threading.Thread(
                target=FileSystemWriterAsync.write_preloaded_data,
                args=(transform_list, i, bucket, results, count, True),
                kwargs={"use_msc": use_msc},
                name=f"megarl-checkpoint-writer-{i}",
                daemon=True,
            )
        )
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    written: dict | Exception = {}
    while not results.empty():
        index, result = results.get_nowait()
        if isinstance(result, Exception):
            written = result
            break
        written[index] = result
    global_results_queue.put(written)


def install() -> bool:
    """Patch megatron's writer (idempotent); False (nothing patched) for other megatron-core versions."""
    if _state["original"] is not None:
        return True
    if not _applies():
        return False
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    writer = fa.FileSystemWriterAsync
    _state["original"] = (writer.__dict__["write_preloaded_data_multiproc"], fa._get_write_results_queue)
    writer.write_preloaded_data_multiproc = staticmethod(_write_in_threads)
    fa._get_write_results_queue = queue.Queue  # one per save: a failed save leaves nothing for the next to read
    return True


def uninstall() -> None:
    """megatron's own writer again (``benchmarks/checkpoint.py`` times both in one run)."""
    if _state["original"] is None:
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    multiproc, results_queue = _state["original"]
    fa.FileSystemWriterAsync.write_preloaded_data_multiproc = multiproc
    fa._get_write_results_queue = results_queue
    _state["original"] = None
