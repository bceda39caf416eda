"""Accelerated inference: init_inference, tensor-parallel serving, int8 weights, KV cache, ZeRO-Inference."""
