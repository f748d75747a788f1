"""Offline tools that make draft heads: ShareGPT data, self-distillation, training. Nothing here runs while serving."""
