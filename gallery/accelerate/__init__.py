"""TorchAcc accelerate() gallery: the LLaMA model with bucketing, eager vs lazy."""
