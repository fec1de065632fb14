"""An inference engine wrapper for tests that check what a workflow sent and got back."""

from __future__ import annotations


class Recorder:
    """Passes calls through to the real engine and keeps every (input_ids, response)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def agenerate(self, req):
        resp = await self.engine.agenerate(req)
        self.calls.append((list(req.input_ids), resp))
        return resp

    def get_version(self):
        return self.engine.get_version()
