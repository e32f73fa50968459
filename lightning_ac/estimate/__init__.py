"""Will it fit? The memory of every mode for a model at the target scale, counted on the CPU on fake tensors."""
