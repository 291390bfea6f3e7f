"""What this machine and launcher offer, found at run time: the CUDA driver,
NCCL and NVRTC libraries and the backend each placement gets (libraries), device
lists (devices), and torchrun's process group (torchrun). Imports nothing of
pyddp above errors."""
