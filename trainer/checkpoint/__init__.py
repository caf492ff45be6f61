"""Checkpoints: everything that reads or writes the run's weights on disk.

* :mod:`~trainer.checkpoint.checkpointer`: ``Checkpointer`` (DCP save/resume/reshard, async, purge);
* :mod:`~trainer.checkpoint.contents`: what a save holds (the Stateful adapters, per-rank paths, the
  marker's fields);
* :mod:`~trainer.checkpoint.storage`: the on-disk layout (folders, marker, CRCs, atomic commit);
* :mod:`~trainer.checkpoint.reader`: safe loading (allow-list unpickler for DCP metadata);
* :mod:`~trainer.checkpoint.space`: disk-room checks and the disk-full error;
* :mod:`~trainer.checkpoint.hf`: Hugging Face safetensors read/write (sharded, distributed);
* :mod:`~trainer.checkpoint.export`: checkpoint -> HF folder (``python -m trainer.export_hf``), and
  the live model -> ``step-N-hf`` at the last step (``checkpoint.last_save_in_hf``);
* :mod:`~trainer.checkpoint.seed`: the seed checkpoint (``checkpoint.create_seed``): its layout and checks;
* :mod:`~trainer.checkpoint.load`: a step-N or HF folder -> a plain model + tokenizer (``trainer.generate``).
"""
