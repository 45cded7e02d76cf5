"""phaseflip.kernels"""
