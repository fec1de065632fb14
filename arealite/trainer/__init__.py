"""Training services the scripts run around each step: HF export (saver), held-out evaluation,
crash recovery, metrics (stats logger). Imports arealite.api and arealite.utils only."""
