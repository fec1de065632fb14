"""Training services the scripts run around each step: HF export (saver), held-out evaluation,
crash recovery, metrics (`timings` times the step's phases, `stats_logger` writes them, with the
progress line and the plots), `timer` (every-N-steps / epochs / seconds). Imports arealite.api,
arealite.utils, arealite.checkpoint and arealite.lifecycle only."""
