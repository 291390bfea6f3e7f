"""A Trainer run's files: checkpoints written atomically and loaded safely
(saving), what a run's result depends on (identity), and the run's files under
its output_dir as every rank sees them (run_files)."""
