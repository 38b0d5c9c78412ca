"""The DeepSeek-V4 network in Flax NNX (pure functions of parameters and token ids)."""
