"""phaseflip.tools"""
