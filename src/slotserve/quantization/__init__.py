"""Weights in fewer bits: the packed formats the CPU kernels multiply (`packed_tensor`, `packed_linear`),
GGUF's quantized blocks read into them as stored (`gguf_blocks`), and int8 linears on torch's kernel (`int8`).
Which of a model's linears run packed is decided in models/packing.py."""
