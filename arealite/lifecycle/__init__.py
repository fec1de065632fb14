"""The lifetime and ownership of a run's processes: every process dies with the one that started
it (`lifeline`: the launchers' side and the trainer's), and one trainer owns a run directory
(`run_lock`, with the fencing token the inference client sends), and a finished process ends
without the interpreter's teardown (`fast_exit`). Imports no other arealite package; the
launchers, the trainer, the recipes, the inference client and the server import it."""
