"""Loading: HF and converted checkpoints into params (``models.load_target`` / ``load_draft``),
tokenizers and chat templates, MXFP4 codes."""
