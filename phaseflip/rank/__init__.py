"""phaseflip.rank"""
