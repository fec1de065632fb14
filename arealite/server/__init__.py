"""Embedded inference server speaking SGLang's native HTTP subset (docs/design.md, wire protocol).
Imports arealite.api, arealite.utils and arealite.openai_wire (the `/v1` chat format) only.

Run it with ``python -m arealite.server --model-path P --port N``; from Python (tests,
launchers) use ``launch_server(model_path) -> ServerProcess``. Importing this package does not
import torch: the model side lives in model_runner / scheduler and loads only in the server.
"""

from arealite.server.process import ServerProcess, launch_server, server_command

__all__ = ["ServerProcess", "launch_server", "server_command"]
