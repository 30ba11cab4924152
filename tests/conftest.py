import torch

# Bitwise-repeatable CPU arithmetic in every test process.
torch.set_num_threads(1)
