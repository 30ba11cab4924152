import torch

# Bitwise-repeatable CPU arithmetic in every test process.
torch.set_num_threads(1)

# One real vLLM server per test session for the live modules (started only when one asks).
from .vllm_server import vllm_checkpoints, vllm_server, vllm_url  # noqa: F401
