"""phaseflip.graphs"""
