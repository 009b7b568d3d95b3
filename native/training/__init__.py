"""LoRA training on the engine's weights: gradients, the optimizer, SFT data and the SFT run."""
