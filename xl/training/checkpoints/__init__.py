"""Checkpoints and run folders: the one reader and the writer, resumes, ``init_from``, the run folder's files and
lock, and the folder of a model train.py did not train."""
