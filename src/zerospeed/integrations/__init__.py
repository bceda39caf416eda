"""Small adapters between zerospeed and the training frameworks that drive DeepSpeed (Hugging Face)."""
