"""What a run reports about itself.

* :mod:`~trainer.observe.metrics`: ``metrics.jsonl`` and the per-step scalars (MFU, memory, ...);
* :mod:`~trainer.observe.trackers`: TensorBoard and Weights & Biases;
* :mod:`~trainer.observe.comm_ledger`: bytes and calls of every collective of a logged step;
* :mod:`~trainer.observe.profiling`: the torch profiler and memory snapshots.
"""
