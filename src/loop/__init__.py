"""The training loop's mechanics, called from train.py: batches and accumulation, the forward pass (compiled or
not), evaluation, early stopping, EMA, and the counters a checkpoint keeps (train_state.py)."""
