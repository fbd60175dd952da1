"""Fine-tuning a classifier to rely less on backgrounds (train.py): one module per concern."""
