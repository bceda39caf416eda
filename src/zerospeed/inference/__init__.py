"""Inference: init_inference, tensor-parallel serving, int8 weights, KV-cached fused decoding, ZeRO-Inference."""
