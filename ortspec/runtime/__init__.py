"""The runtime layer: sessions over shared weights, state kinds, engines, CUDA-graph slots; one forward at a time."""
