"""The pieces of tools/train_tiny.py: corpus and tokenizer, objective, evaluation, checkpoint output."""
