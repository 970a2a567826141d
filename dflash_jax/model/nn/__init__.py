"""The pieces shared by every target family and the draft: RoPE, the attention mixer, the dense
and routed feed-forward blocks, and the decoder that runs a stack of them from per-layer specs."""
