"""Images for vision-language models: loading, preprocessing (Qwen3-VL)."""
