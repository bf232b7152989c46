"""Quantizers and their files: k-means, PQ codebooks (one set or a model's key / value set laid
out per layer), key / value transforms, residual stages, uniform (KIVI-style) int codes, and the
safetensors + JSON codebook files."""
