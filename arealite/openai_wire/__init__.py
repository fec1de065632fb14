"""The OpenAI chat-completions wire format, one definition for the embedded server's `/v1`
endpoint and the agent's training client: request validation and prompt rendering
(`request.py`), response bodies, stream chunks and error bodies (`response.py`), tool calls in
the model's text (`tool_calls.py`). Plain dicts, no `openai` import.
Imports arealite.api and arealite.utils only; arealite.server and arealite.agent import it."""
