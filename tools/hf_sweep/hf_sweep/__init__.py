"""The Hugging Face TP sweep: enumerate families, run each in its own 4-rank process, report."""
