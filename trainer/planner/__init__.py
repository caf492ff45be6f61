"""The planner: per-rank memory and per-step communication of a layout, before launch
(``python -m trainer.plan``, the command line in ``trainer/plan.py``).

* :mod:`~trainer.planner.cluster`: the machine (``configs/cluster/``), ring cost, schedule formulas;
* :mod:`~trainer.planner.params`: the parameter table of a meta-device model (TP kinds per module);
* :mod:`~trainer.planner.context`: the shared types (``Plan``, ``Collective``) and ``PlanContext``;
* :mod:`~trainer.planner.activations`: what one block and the head save per local token (the dtype policy);
* :mod:`~trainer.planner.memory`: activations, model states and buffers per pipeline rank;
* :mod:`~trainer.planner.comm`: the collectives of one step on one rank;
* :mod:`~trainer.planner.checkpoint`: one checkpoint save, bytes and files per rank;
* :mod:`~trainer.planner.plan`: ``build_plan`` and its verdict;
* :mod:`~trainer.planner.report`: the tables the command prints;
* :mod:`~trainer.planner.recommend`: ``--recommend``, a layout for the model on the cluster;
* :mod:`~trainer.planner.compare`: ``--run``, planned vs measured (the communication ledger).
"""
