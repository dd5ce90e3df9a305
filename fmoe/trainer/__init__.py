"""The main job's parts: settings (``options``), checks before any process group
(``setup``), one live run per folder (``run_lock``), one process per rank
(``launch``), the loop (``loop``) and what it records (``metrics``).
``python -m fmoe.train`` runs them."""
