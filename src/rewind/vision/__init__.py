"""Image prompts: decoding and limits (images), tower-output reuse (features), the mlx-vlm
adapter that turns image spans into input embeddings (vlm), and request preparation
(prompting). Everything but `images` and `features` needs the `vision` extra (mlx-vlm)."""
