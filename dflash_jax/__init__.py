"""DFlash block-diffusion speculative decoding in JAX and Pallas.

Layers, each importing only those listed before it (and ``pallas_kernels``):

- ``model``: configs, target families, the decoder's layers, target and draft forwards, params,
  the paged cache and its tensor-parallel layout, the kernel dispatch (``model.ops``);
- ``loading``: checkpoints, tokenizers, MXFP4 codes, ``load_target`` / ``load_draft``;
- ``runtime``: the jitted prefill / decode programs, sampling, the serving engine, several hosts;
- ``entrypoints``: the ``generate`` library call and command line, the OpenAI server;
- ``training``: draft and target training and their data.

``python -m dflash_jax.generate`` and ``python -m dflash_jax.serve`` are the command lines.
"""
