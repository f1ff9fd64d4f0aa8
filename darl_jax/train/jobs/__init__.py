"""Jobs with a driver of their own (nothing to train): sampling, few-shot, kNN, VTAB."""
