"""The torch reference ops: written plainly, the oracles every kernel is tested against, and the eager
CPU body of the pointwise ops (norm, rotary, activation)."""
