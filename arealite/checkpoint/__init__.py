"""Checkpoint files: written so a reader never sees half a checkpoint (`save_load`: shard by shard
into a temporary sibling swapped in whole; RNG states) and read without running code
(`safe_state`: tagged JSON, a pickle-free DCP metadata reader). Imports no other arealite
package; the engine and the trainer's recover import it."""
