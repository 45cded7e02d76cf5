"""phaseflip.layouts"""
