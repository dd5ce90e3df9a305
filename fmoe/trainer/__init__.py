"""The main job's parts: settings (``options``: flags, TOML, presets; ``run_settings``:
the job's own, typed), checks before any process group (``setup``), one live run per
folder (``run_lock``), one process per rank (``launch``), the loop (``loop``), what it
starts from and saves (``checkpointing``; a resumed run's settings: ``resuming``; its
learning rate across resumes: ``lr_schedule``) and what it records (``metrics``).
``python -m fmoe.train`` runs them."""
