"""Training services the scripts run around each step: HF export (saver), held-out evaluation,
crash recovery, metrics (`stats_tracker` records them, `stats_logger` writes them, with the
progress line and the plots), `timer` (every-N-steps / epochs / seconds). Imports arealite.api,
arealite.utils, arealite.checkpoint and arealite.lifecycle only."""
