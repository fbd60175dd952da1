"""Backgrounds Challenge toolkit: IN-9 accuracy, the adversarial-background challenge, and analyses."""

__version__ = "0.1.0"
