"""Helpers several packages use: batches (`data`: pad / concat / pack / split), `distributed`,
`hardware` (dtype `auto`), `network` (free ports), `tensor_handles` (weights by CUDA IPC handle),
`vision` (images), `loop_thread` (an asyncio loop for synchronous callers), and the FSDP and
log-prob helpers (`fsdp`, `logprobs`). Imports no other arealite package (so anything may import
it)."""
