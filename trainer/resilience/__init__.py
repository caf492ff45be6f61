"""Keeping a run alive, or stopping it cleanly.

* :mod:`~trainer.resilience.watchdog`: collective timeouts and hang reports;
* :mod:`~trainer.resilience.preemption`: SIGTERM / SIGUSR1 -> checkpoint together and exit;
* :mod:`~trainer.resilience.guards`: non-finite loss / gradient guards;
* :mod:`~trainer.resilience.fault_tolerance`: torchft replica groups (a lost group does not stop the others);
* :mod:`~trainer.resilience.supervisor`: the fault-tolerant launchers' lighthouse, restart loops and hang
watchdog.
"""
