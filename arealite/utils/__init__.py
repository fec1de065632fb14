"""Helpers several packages use: batches (`data`: pad / concat / pack / split), `distributed`,
`hardware` (dtype `auto`), `network` (free ports), `tensor_handles` (weights by CUDA IPC handle),
`vision` (images) and `loop_thread` (an asyncio loop for synchronous callers). Imports no other
arealite package (so anything may import it)."""
