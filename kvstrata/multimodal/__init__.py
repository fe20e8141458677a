"""Image input for vision-language models: loading, preprocessing, towers and connectors, image-hash
placeholder tokens, and the assembled demo model (``python -m kvstrata.multimodal.assemble``)."""
