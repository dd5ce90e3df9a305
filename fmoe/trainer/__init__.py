"""The main job's parts: settings (``options``: flags, TOML, presets; ``run_settings``:
the job's own, typed), checks before any process group (``setup``), one live run per
folder (``run_lock``), one process per rank (``launch``), the loop (``loop``), what it
starts from and saves (``checkpointing``) and what it records (``metrics``).
``python -m fmoe.train`` runs them."""
