"""Keeping a run alive, or stopping it cleanly.

* :mod:`~trainer.resilience.watchdog`: collective timeouts and hang reports;
* :mod:`~trainer.resilience.preemption`: SIGTERM / SIGUSR1 -> checkpoint together and exit;
* :mod:`~trainer.resilience.guards`: non-finite loss / gradient guards.
"""
