"""The runtime: jitted prefill and decode programs over a decode state, sampling and acceptance,
the serving engine (slots, continuous batching), several hosts."""
