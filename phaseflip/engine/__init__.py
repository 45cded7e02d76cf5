"""phaseflip.engine"""
