"""Evaluation while training and after: downstream tasks (``tasks.py``: the JSONL format and token
requests; ``scoring.py``: batched log-likelihood / greedy scoring on the sharded model and the
metrics; ``evaluator.py``: what the Trainer calls), named validation sets (``validation.py``) and
the converter for public benchmark files (``convert.py``)."""
