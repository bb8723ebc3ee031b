"""Image prompts: decoding and limits (images), tower-output reuse (features), the families'
base types (family), one module per family, the list of them (registry), the mlx-vlm adapter
that turns image spans into input embeddings (vlm), and request preparation (prompting).
Everything but `images` and `features` needs the `vision` extra (mlx-vlm)."""
