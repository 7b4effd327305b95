"""What a training run did, to look at: the pictures of its plan and memory (``pictures``, drawn per
step by the job's ``train/metrics.py`` and for the whole run here) and the run report
(``python -m hilore_actor.report RUN_DIR``: ``page``), read from the run folder alone
(``run_folder``). Part of the training job's application: it reads the files the job writes."""
