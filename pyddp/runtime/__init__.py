"""What this machine and launcher offer, found at run time: the CUDA driver,
NCCL and NVRTC libraries and the backend each placement gets (libraries), device
lists (devices), torchrun's process group (torchrun), and oneMKL's first
calls made before replica threads race on them (mkl). Imports nothing of
pyddp above errors."""
