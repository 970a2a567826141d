"""The model: configs, families, layers, the target and draft forwards, params and the paged cache.
Imports nothing from the other layers of ``dflash_jax``."""
