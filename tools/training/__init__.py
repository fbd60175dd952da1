"""Fine-tuning a classifier to rely less on backgrounds (train.py, bgc-train: `cli`): one module per concern."""
